"""The autoscaler's decision: a pure function of the metric samples, the fleet's state and the clock.

Modelled on Knative's KPA: the desired count is the demand (requests running plus waiting, over the
replicas) divided by the target per replica, averaged over a stable window (a fleet sized on several
figures, such as a disaggregated service's decode role on requests and KV cache, takes the most any of them
wants); a short panic window reacts to bursts, and while it is active the fleet never shrinks. Scale-down
waits for the highest recommendation of a delay window (no flapping), steps are bounded, and replicas the
scheduler cannot place hold scale-up, so the fleet does not keep asking for GPUs that are not there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from kvfleet.contract.kv_transfer import Role
from kvfleet.operator.spec import InferenceServiceSpec, ScalingSpec

# Keeps a float demand of exactly N targets from rounding up to N + 1.
_CEIL_EPSILON = 1e-9

# A latency histogram's observations of one interval, as Prometheus keeps them: (upper bound, observations at
# or below it), the bounds ascending, the last +Inf.
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class PodMetrics:
    """What one ready replica reported in one scrape."""

    waiting: float
    running: float
    kv_cache_usage: float | None = None
    # Mean time to first token of the requests that started since the previous scrape, if any did.
    ttft_seconds: float | None = None
    # Prompt tokens still to compute, of the waiting and running requests.
    queued_prompt_tokens: float | None = None
    # Mean time between output tokens since the previous scrape, if any were generated.
    itl_seconds: float | None = None
    # The same latencies' histograms since the previous scrape, where the replica exports their buckets.
    ttft_buckets: Buckets | None = None
    itl_buckets: Buckets | None = None
    # Prompt tokens of requests whose prefill finished, and tokens generated, per second since the previous
    # scrape.
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None

    @property
    def queue_depth(self) -> float:
        return self.waiting + self.running


# A wait share is taken past a target's tail only where the window's count of waits makes it so at the lower
# end of its one-sided 95% confidence interval: a few requests that arrived together are chance.
_WAITS_CONFIDENCE_Z = 1.645


@dataclass(frozen=True)
class Waits:
    """Of the requests that reached the gateway (sent to a replica or refused), those that waited in its
    queue because no replica had room: each waited there before any latency a replica measures. Counts, not
    a share, so that a window's share is that of all its requests: a request that waits across a scrape is
    counted as waited in one sample and as arrived in the next, and a share per sample would make it all of
    its sample's requests (at a sixth of a replica's throughput, a tenth of a ten-scrape window's)."""

    arrived: float = 0.0
    waited: float = 0.0

    @staticmethod
    def over(samples: Iterable[MetricsSample]) -> Waits:
        samples = list(samples)
        return Waits(sum(s.waits.arrived for s in samples), sum(s.waits.waited for s in samples))

    @property
    def share(self) -> float:
        """The share that waited (all of them where some wait and none arrived yet)."""
        if self.waited <= 0:
            return 0.0
        return min(1.0, self.waited / self.arrived) if self.arrived > 0 else 1.0

    def beyond(self, tail: float) -> bool:
        """Whether more of the requests waited than `tail` (any, where it is 0) by more than chance: the
        lower bound of the share's Wilson score interval is past it. At a p90 target, 2 of 13 requests
        (15%) are within chance, 4 of 13 past it."""
        if self.waited <= 0 or tail <= 0:
            return self.waited > 0
        count, share, z = max(self.arrived, self.waited), self.share, _WAITS_CONFIDENCE_Z
        spread = z * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count))
        return (share + z * z / (2 * count) - spread) / (1 + z * z / count) > tail


@dataclass(frozen=True)
class MetricsSample:
    """The fleet's demand at one instant, estimated from the replicas that answered."""

    time: float
    queue_depth: float
    reporting_pods: int
    kv_cache_usage: float | None = None
    ttft_seconds: float | None = None
    # The fleet's prompt tokens still to compute, estimated as queue_depth is.
    queued_prompt_tokens: float | None = None
    # The KV cache in use over the fleet, in replicas' worth: the mean share in use times the replicas.
    kv_cache_in_use: float | None = None
    itl_seconds: float | None = None
    # Of queue_depth, the requests the gateway held: none of the replicas had room for them.
    held: float = 0.0
    # The replicas' latency histograms of the interval, added up: the fleet's.
    ttft_buckets: Buckets | None = None
    itl_buckets: Buckets | None = None
    # The fleet's token throughput, estimated as queue_depth is.
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    # Of the requests that reached the gateway since the previous sample, the share it refused for want of
    # room (its queue full, or held past its time): demand that neither a replica nor the queue shows.
    refused_share: float = 0.0
    waits: Waits = Waits()


Figure = Literal["queue depth", "queued prompt tokens", "KV cache in use"]
Latency = Literal["time to first token", "inter-token latency"]


@dataclass(frozen=True)
class Target:
    """A figure of the fleet and how much of it one replica should carry: it wants figure / per_replica."""

    figure: Figure
    per_replica: float


@dataclass(frozen=True)
class LatencyTarget:
    """A latency the fleet's replicas should keep: at this percentile of their requests, or on average (None);
    while it is missed the fleet grows."""

    latency: Latency
    seconds: float
    percentile: float | None = None

    def describe(self) -> str:
        statistic = f"p{self.percentile:g}" if self.percentile is not None else "mean"
        return f"{self.latency} {statistic}"


@dataclass(frozen=True)
class Sizing:
    """What one workload of a service is scaled by: the policy, the figures it is sized on, the latency its
    replicas should keep."""

    policy: ScalingSpec
    targets: tuple[Target, ...]
    latency: LatencyTarget | None = None
    # The latencies the `slo` policy sizes the workload on.
    slo: tuple[LatencyTarget, ...] = ()


def sizing(spec: InferenceServiceSpec, role: Role | None = None) -> Sizing:
    """A colocated service is sized on its queue depth and held to its time to first token; a prefill role
    on its queued prompt tokens and the same time to first token; a decode role on its queue depth and KV
    cache in use, and held to its inter-token latency. The `slo` policy sizes a colocated service on both
    latencies, a prefill role on its time to first token and a decode role on its inter-token latency."""
    ttft_target = _latency_target("time to first token", spec.sla.ttft_target_milliseconds)
    itl_target = _latency_target("inter-token latency", spec.sla.itl_target_milliseconds)
    percentile = spec.sla.percentile
    if role is None:
        slo = _at(percentile, ttft_target, itl_target)
        return Sizing(
            spec.scaling, (Target("queue depth", spec.scaling.target_queue_depth),), ttft_target, slo
        )
    assert spec.disaggregation is not None
    if role == "prefill":
        prefill = spec.disaggregation.prefill.scaling
        target = Target("queued prompt tokens", prefill.target_queued_prompt_tokens)
        return Sizing(prefill.policy(spec.scaling), (target,), ttft_target, _at(percentile, ttft_target))
    decode = spec.disaggregation.decode.scaling
    targets = (
        Target("queue depth", decode.target_queue_depth),
        Target("KV cache in use", decode.target_kv_cache_usage_percent / 100),
    )
    latency = _latency_target("inter-token latency", decode.itl_target_milliseconds)
    return Sizing(decode.policy(spec.scaling), targets, latency, _at(percentile, latency or itl_target))


def _latency_target(latency: Latency, milliseconds: int | None) -> LatencyTarget | None:
    return LatencyTarget(latency, milliseconds / 1000) if milliseconds is not None else None


def _at(percentile: float, *targets: LatencyTarget | None) -> tuple[LatencyTarget, ...]:
    """The targets given, held at the percentile (the `slo` policy's)."""
    return tuple(replace(target, percentile=percentile) for target in targets if target is not None)


@dataclass(frozen=True)
class FleetState:
    """The Deployment as it is when a decision is taken."""

    # What the operator last asked the Deployment for.
    current_replicas: int
    ready_replicas: int
    # Pending pods the scheduler found no room for (usually: no free GPUs).
    unschedulable_replicas: int = 0


@dataclass(frozen=True)
class AutoscalerState:
    """What a decision carries over to the next one."""

    panic_until: float | None = None
    # (time, wanted replicas) of recent decisions, for the scale-down delay.
    recommendations: tuple[tuple[float, int], ...] = ()
    # Since when the latest samples have shown no demand at all, for scaling to zero.
    idle_since: float | None = None
    # By latency, the tokens per second a replica served the last time the gateway held requests (it had no
    # room for more): what one replica can do, remembered past the stable window, as it does not change
    # with the load.
    full_throughput: tuple[tuple[Latency, float], ...] = ()
    # By latency, the most tokens per second a replica has served with that latency within its target: how
    # far the latency line has been seen to hold, remembered past the stable window, so that a quiet window
    # (a few requests, unevenly spread) does not make that look like the most a replica can be trusted with.
    proven_throughput: tuple[tuple[Latency, float], ...] = ()

    def for_a_new_template(self) -> AutoscalerState:
        """What carries over to replicas of another template (another model, engine settings or GPUs), which
        may serve more or less: not the throughput the old ones were measured at, which is measured again."""
        return replace(self, full_throughput=(), proven_throughput=())


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str
    panic: bool
    state: AutoscalerState
    # A latency whose target is below what a replica measures with no load to speak of: no count meets it.
    unreachable: Latency | None = None


def aggregate(
    time: float,
    reports: Sequence[PodMetrics | None],
    ready_replicas: int,
    held: float = 0.0,
    refused_share: float = 0.0,
    waits: Waits = Waits(),
) -> MetricsSample | None:
    """One fleet sample from the ready replicas' reports, the requests the gateway holds for the service, the
    share of those that reached it since the previous sample that it refused, and the waits in its queue;
    None when no replica answered.

    A replica that failed to report is assumed as busy as the average of those that did: it neither
    blocks scaling nor counts as idle.
    """
    answered = [report for report in reports if report is not None]
    if not answered:
        return None
    mean_depth = _mean(report.queue_depth for report in answered)
    replicas = max(ready_replicas, len(answered))
    kv = _mean_or_none(report.kv_cache_usage for report in answered)
    prompt_tokens = _mean_or_none(report.queued_prompt_tokens for report in answered)
    prompt_rate = _mean_or_none(report.prompt_tokens_per_s for report in answered)
    generation_rate = _mean_or_none(report.generation_tokens_per_s for report in answered)
    return MetricsSample(
        time=time,
        queue_depth=mean_depth * replicas + held,
        reporting_pods=len(answered),
        kv_cache_usage=kv,
        ttft_seconds=_mean_or_none(report.ttft_seconds for report in answered),
        queued_prompt_tokens=prompt_tokens * replicas if prompt_tokens is not None else None,
        kv_cache_in_use=kv * replicas if kv is not None else None,
        itl_seconds=_mean_or_none(report.itl_seconds for report in answered),
        held=held,
        ttft_buckets=added_buckets(report.ttft_buckets for report in answered),
        itl_buckets=added_buckets(report.itl_buckets for report in answered),
        prompt_tokens_per_s=prompt_rate * replicas if prompt_rate is not None else None,
        generation_tokens_per_s=generation_rate * replicas if generation_rate is not None else None,
        refused_share=refused_share,
        waits=waits,
    )


def added_buckets(histograms: Iterable[Buckets | None]) -> Buckets | None:
    """The histograms added up, bucket by bucket; those whose bounds differ from the first one's (a replica
    of another version) are left out. None without any."""
    total: list[list[float]] | None = None
    for histogram in histograms:
        if histogram is None:
            continue
        if total is None:
            total = [[bound, count] for bound, count in histogram]
        elif [bound for bound, _ in histogram] == [bound for bound, _ in total]:
            for bucket, (_, count) in zip(total, histogram, strict=True):
                bucket[1] += count
    return tuple((bound, count) for bound, count in total) if total is not None else None


def histogram_quantile(quantile: float, buckets: Buckets) -> float | None:
    """The quantile (0 to 1) of a histogram's observations, as Prometheus' histogram_quantile estimates it:
    linear within the bucket it falls in, the lowest bucket taken to start at 0, and the highest finite bound
    when it falls in the +Inf bucket. None without observations or without the +Inf bucket."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return None
    rank = quantile * buckets[-1][1]
    index = next(index for index, (_, count) in enumerate(buckets) if count >= rank)
    bound, count = buckets[index]
    if bound == math.inf:
        return buckets[index - 1][0]
    if index == 0:
        return bound if bound <= 0 else bound * rank / count
    below_bound, below_count = buckets[index - 1]
    return below_bound + (bound - below_bound) * (rank - below_count) / (count - below_count)


def decide(
    policy: ScalingSpec,
    samples: Sequence[MetricsSample],
    fleet: FleetState,
    state: AutoscalerState,
    now: float,
    latency: LatencyTarget | None = None,
    targets: Sequence[Target] | None = None,
    slo: Sequence[LatencyTarget] = (),
) -> ScaleDecision:
    """Replicas the fleet should have now, with the reason a user would want to read. `targets`: the figures
    the fleet is sized on; by default the queue depth at the policy's target. `slo`: the latencies the `slo`
    policy sizes it on; until the window holds one measured under load, it is sized as by queue depth."""
    current = fleet.current_replicas
    targets = targets if targets is not None else [Target("queue depth", policy.target_queue_depth)]
    stable = [s for s in samples if now - policy.stable_window_seconds < s.time <= now]
    if not any(_figure(s, target.figure) is not None for s in stable for target in targets):
        replicas = policy.clamp(current)
        return ScaleDecision(replicas, _bounded_reason(replicas, current, "no metrics yet"), False, state)

    panic_samples = [s for s in stable if now - policy.panic_window_seconds < s.time] or stable[-1:]
    wanted, reason, panic_until = _wanted_for_demand(
        policy, targets, stable, panic_samples, fleet, state, now
    )
    by_slo = _wanted_for_slo(policy, slo, stable, panic_samples, state) if policy.policy == "slo" else None
    unreachable = None
    if by_slo is not None:
        wanted, reason, unreachable, panic_until = by_slo.replicas, by_slo.reason, by_slo.unreachable, None
        state = replace(
            state, full_throughput=by_slo.full_throughput, proven_throughput=by_slo.proven_throughput
        )
    panic = panic_until is not None
    observed = _mean_or_none(_latency(s, latency.latency) for s in panic_samples) if latency else None
    panic_demand = _mean(s.queue_depth for s in panic_samples)
    if latency is not None and observed is not None and observed > latency.seconds and panic_demand > 0:
        wanted, reason = _latency_floor(wanted, reason, fleet, observed, latency)

    # A first decision knows nothing of what was wanted over the scale-down delay: the count the Deployment
    # has stands for it, so a fleet is not shrunk on its first few seconds of metrics.
    earlier = state.recommendations or ((now, current),)
    recent = [(time, count) for time, count in earlier if now - time < policy.scale_down_delay_seconds]
    recommendations = (*recent, (now, wanted))
    replicas, reason = _stepped(policy, fleet, wanted, reason, recommendations)
    bounded = policy.clamp(replicas)
    reason = _bounded_reason(bounded, replicas, reason)
    idle_since = (
        None if stable[-1].queue_depth > 0 else (state.idle_since if state.idle_since is not None else now)
    )
    if bounded == 0 and current > 0:
        bounded, reason = _scale_to_zero(policy, reason, now - idle_since if idle_since is not None else 0.0)
    new_state = replace(
        state, panic_until=panic_until, recommendations=recommendations, idle_since=idle_since
    )
    return ScaleDecision(bounded, reason, panic, new_state, unreachable)


def _wanted_for_demand(
    policy: ScalingSpec,
    targets: Sequence[Target],
    stable: Sequence[MetricsSample],
    panic_samples: Sequence[MetricsSample],
    fleet: FleetState,
    state: AutoscalerState,
    now: float,
) -> tuple[int, str, float | None]:
    """Replicas the figures ask for (the most any of them wants), why, and until when panic mode lasts
    (None: not in panic).

    A burst on the short window that wants the panic threshold's share of the ready replicas starts panic
    mode, which lasts a stable window: meanwhile the fleet follows the short window and never shrinks.
    """
    current = fleet.current_replicas
    stable_wanted = _most_wanted(targets, stable, policy.stable_window_seconds)
    assert stable_wanted is not None, "decide() saw a figure in the stable window"
    panic_wanted = _most_wanted(targets, panic_samples, policy.panic_window_seconds) or stable_wanted
    wanted_panic, panic_reason = panic_wanted
    over_threshold = wanted_panic * 100 >= policy.panic_threshold_percent * max(fleet.ready_replicas, 1)
    panic_until = state.panic_until
    if over_threshold and wanted_panic > current:
        panic_until = now + policy.stable_window_seconds
    if panic_until is not None and now < panic_until:
        return max(wanted_panic, current), f"panic: {panic_reason}", panic_until
    wanted, reason = stable_wanted
    return wanted, reason, None


# The most of the demand taken to be refused: a gateway that refuses nearly everything says the fleet is
# short, not by how much, and the next decisions see the rest.
_MOST_REFUSED = 0.9


@dataclass(frozen=True)
class LatencyModel:
    """A replica's latency as a line in the load it carries (requests held, or tokens per second):
    idle + per_unit × load."""

    idle: float
    per_unit: float
    # The most load per replica it was measured at: it is not trusted beyond twice that.
    measured_up_to: float
    # The load per replica while the gateway held more requests than the target's tail: a replica takes no
    # more, and what waits in the gateway waits longer than any replica reports. A fleet sized there is not
    # kept full: what the gateway holds counts in the demand.
    full_at: float | None = None

    def capacity(self, target_seconds: float) -> float:
        """The load a replica can carry with its latency within the target."""
        most = 2 * self.measured_up_to
        if self.full_at is not None:
            most = min(most, self.full_at)
        if self.per_unit <= 0:
            return most if self.idle <= target_seconds else 0.0
        return max(0.0, min(most, (target_seconds - self.idle) / self.per_unit))


@dataclass(frozen=True)
class Unit:
    """What a fleet's load is counted in: the demand on the fleet, and what its replicas carried of it (the
    requests the gateway held are demand that no replica carries)."""

    name: str
    demand: Callable[[MetricsSample], float | None]
    carried: Callable[[MetricsSample], float | None]

    def per_replica(self, sample: MetricsSample) -> float | None:
        carried = self.carried(sample)
        return carried / sample.reporting_pods if carried is not None and sample.reporting_pods else None


def _with_refused(sample: MetricsSample, demand: float) -> float:
    """The demand the sample shows, and what the gateway refused beside it."""
    return demand / (1 - min(sample.refused_share, _MOST_REFUSED))


REQUESTS = Unit("requests", lambda s: _with_refused(s, s.queue_depth), lambda s: s.queue_depth - s.held)


def _token_unit(name: str, served: Callable[[MetricsSample], float | None]) -> Unit:
    def demand(sample: MetricsSample) -> float | None:
        # The requests the gateway held are demand the replicas had no room for: the tokens served, scaled up
        # by the requests waiting over those the replicas hold. Once the gateway refuses some, its queue is
        # as long as it gets and the replicas serve what it admits: the share refused says how much more
        # arrives, and the held requests counted as well would count that excess again.
        tokens, carried = served(sample), sample.queue_depth - sample.held
        if tokens is None or (sample.held > 0 and carried <= 0):
            return None
        if sample.held > 0 and sample.refused_share == 0:
            tokens *= sample.queue_depth / carried
        return _with_refused(sample, tokens)

    return Unit(name, demand, served)


# The throughput each latency depends on: a prompt waits for the prompt tokens before it, a token for the
# tokens generated beside it.
THROUGHPUT: dict[Latency, Unit] = {
    "time to first token": _token_unit("prompt tokens/s", lambda s: s.prompt_tokens_per_s),
    "inter-token latency": _token_unit("generated tokens/s", lambda s: s.generation_tokens_per_s),
}


def latency_model(
    samples: Sequence[MetricsSample],
    latency: Latency,
    percentile: float | None = None,
    unit: Unit = REQUESTS,
    proportional: bool = False,
) -> LatencyModel | None:
    """The line through the samples' (load per reporting replica in `unit`, latency at the percentile or
    mean), by least squares; through the origin when the load never varied, the fit says latency falls
    with load, or `proportional` asks for latency in proportion to the load. The requests the gateway held
    are not the replicas': they wait before any latency a replica measures. A replica is full, at the median
    load of those samples, where the gateway held more of the requests than the percentile leaves to its tail
    (any, for the mean), in a window where more of the requests that arrived waited there than that tail, by
    more than chance: a p90 target tolerates a tenth of the requests waiting. None without a latency measured
    under load."""
    points = _loads_and_latencies(samples, latency, percentile, unit)
    if not points:
        return None
    tail = 0.0 if percentile is None else 1 - percentile / 100
    # A scrape that caught two requests arriving together at a low load shows a held request too, and a
    # replica's load over that second is what came, not what it takes: sized at it, a fleet carrying a sixth
    # of a replica's throughput doubled, or kept the replica it had added for a peak.
    waited_beyond_tail = Waits.over(samples).beyond(tail)
    full = [
        load
        for s in samples
        if waited_beyond_tail and s.held > tail * s.queue_depth and (load := unit.per_replica(s)) is not None
    ]
    # The median: a fleet of one or two replicas scraped every second shows a handful of requests a scrape,
    # and the highest of them is chance (a scrape that missed a replica divides by one).
    full_at = statistics.median(full) if full else None
    loads = [load for load, _ in points]
    mean_load, mean_latency = _mean(loads), _mean(value for _, value in points)
    spread = sum((load - mean_load) ** 2 for load in loads)
    if spread > 0 and not proportional:
        slope = sum((load - mean_load) * (value - mean_latency) for load, value in points) / spread
        idle = mean_latency - slope * mean_load
        if slope > 0 and idle >= 0:
            return LatencyModel(idle, slope, max(loads), full_at)
    return LatencyModel(0.0, mean_latency / mean_load, max(loads), full_at)


def _loads_and_latencies(
    samples: Sequence[MetricsSample], latency: Latency, percentile: float | None, unit: Unit
) -> list[tuple[float, float]]:
    """Each sample's (load per reporting replica in `unit`, latency), where it had both and some load."""
    held_to = _left_to_replicas(samples, latency, percentile)
    return [
        (load, value)
        for s in samples
        if (load := unit.per_replica(s)) is not None
        and load > 0
        and (value := _latency(s, latency, held_to)) is not None
    ]


def _left_to_replicas(
    samples: Sequence[MetricsSample], latency: Latency, percentile: float | None
) -> float | None:
    """The percentile at which the samples' replicas' latency is read: what the gateway's queue left of the
    target's tail. A request that waited there for a replica's room is counted in the tail of the time to
    first token (its wait comes before any latency a replica measures, and lasts until some request in
    flight finishes), so the replicas keep the rest: at p95 with 2% of the requests waiting, their own p97.
    The share is the window's, so that the percentile does not jump from one scrape to the next. The
    replicas keep half the tail at least, as a percentile nearer 100 is read from a histogram's last few
    observations; with a quarter, the multi-tenant fleet of docs/benchmarks.md (cohort model) kept 94.97% of
    its requests within a p95 target, with half 96.7%."""
    if percentile is None or latency != "time to first token" or not samples:
        return percentile
    waited = Waits.over(samples).share
    return min(percentile + 100 * waited, percentile + (100 - percentile) / 2)


def forecast_demand(
    samples: Sequence[MetricsSample], recent: Sequence[MetricsSample], horizon: float, unit: Unit = REQUESTS
) -> float:
    """The fleet's demand in `unit` `horizon` seconds after the latest sample, on the window's linear trend
    taken at the low end of its slope's 95% interval (see `_rise_beyond_noise`); never below the recent mean
    (a falling trend is left to the scale-down delay)."""
    points = [(s.time, demand) for s in samples if (demand := unit.demand(s)) is not None]
    current = _mean_or_none(unit.demand(s) for s in recent)
    if current is None:
        current = points[-1][1] if points else 0.0
    if not points:
        return current
    times = [time for time, _ in points]
    mean_time = _mean(times)
    spread = sum((time - mean_time) ** 2 for time in times)
    if spread == 0:
        return current
    mean_demand = _mean(demand for _, demand in points)
    slope = sum((time - mean_time) * (demand - mean_demand) for time, demand in points) / spread
    rise = _rise_beyond_noise(points, mean_time, mean_demand, slope, spread)
    return max(current, mean_demand + rise * (max(times) + horizon - mean_time))


def _rise_beyond_noise(
    points: Sequence[tuple[float, float]], mean_time: float, mean_demand: float, slope: float, spread: float
) -> float:
    """The least-squares slope less twice its standard error, and none below zero: a small fleet's one-second
    counts of a request or two have steep slopes by chance, which extended half a window ahead ask for
    replicas the demand never needs, while a ramp's counts lie close to its line and keep most of theirs. Two
    points leave no scatter to judge by, and their slope is taken."""
    if len(points) < 3:
        return slope
    residuals = sum((demand - mean_demand - slope * (time - mean_time)) ** 2 for time, demand in points)
    standard_error = math.sqrt(residuals / (len(points) - 2) / spread)
    return max(0.0, slope - 2 * standard_error)


@dataclass(frozen=True)
class _SloDecision:
    replicas: int
    reason: str
    unreachable: Latency | None
    full_throughput: tuple[tuple[Latency, float], ...]
    proven_throughput: tuple[tuple[Latency, float], ...]


def _wanted_for_slo(
    policy: ScalingSpec,
    slo: Sequence[LatencyTarget],
    stable: Sequence[MetricsSample],
    recent: Sequence[MetricsSample],
    state: AutoscalerState,
) -> _SloDecision | None:
    """The fewest replicas whose modelled latency meets every target at the demand forecast half a stable
    window ahead, why, and the latency no replica count can meet, if any; None until some target has a
    latency measured under load. Where the replicas report their token counters, the load is the token
    throughput the latency depends on: what a replica served while the gateway held requests bounds its
    capacity until it is measured again, and the most it has served within the target is as far as the
    latency line is known to hold."""
    horizon = policy.stable_window_seconds / 2
    best: tuple[int, str, Latency | None] | None = None
    full_throughput = dict(state.full_throughput)
    proven_throughput = dict(state.proven_throughput)
    for target in slo:
        unit = THROUGHPUT[target.latency]
        reporting = [s for s in stable if s.reporting_pods]
        if not reporting or unit.carried(reporting[-1]) is None:
            unit = REQUESTS
        model = latency_model(stable, target.latency, target.percentile, unit)
        if model is None:
            continue
        proven = _most_within_target(stable, target, unit)
        if unit is not REQUESTS:
            proven = max(proven_throughput.get(target.latency, 0.0), proven)
        if proven > 0 and model.capacity(target.seconds) <= 0:
            # The line puts an idle replica above the target, yet a replica has been measured within it: a
            # line fitted to loads far from none says nothing of an idle replica (a fleet running hot at a
            # steady load). The latency is taken in proportion to the load instead.
            model = latency_model(stable, target.latency, target.percentile, unit, proportional=True)
            assert model is not None, "the same samples gave a line above"
        if unit is not REQUESTS:
            if model.full_at is not None:
                full_throughput[target.latency] = model.full_at
            elif target.latency in full_throughput:
                model = replace(model, full_at=full_throughput[target.latency])
            if proven > 0:
                proven_throughput[target.latency] = proven
                model = replace(model, measured_up_to=max(model.measured_up_to, proven))
        wanted, why, unreachable = _fewest(policy, target, model, unit, stable, recent, horizon)
        if best is None or wanted > best[0] or (unreachable and not best[2]):
            best = wanted, why, unreachable
    if best is None:
        return None
    return _SloDecision(
        *best, tuple(sorted(full_throughput.items())), tuple(sorted(proven_throughput.items()))
    )


def _most_within_target(samples: Sequence[MetricsSample], target: LatencyTarget, unit: Unit) -> float:
    """The most load a replica carried in `samples` with its latency within the target (0 if none)."""
    points = _loads_and_latencies(samples, target.latency, target.percentile, unit)
    return max((load for load, value in points if value <= target.seconds), default=0.0)


def _fewest(
    policy: ScalingSpec,
    target: LatencyTarget,
    model: LatencyModel,
    unit: Unit,
    stable: Sequence[MetricsSample],
    recent: Sequence[MetricsSample],
    horizon: float,
) -> tuple[int, str, Latency | None]:
    """The replicas one target wants, why, and its latency when no count meets it."""
    forecast = forecast_demand(stable, recent, horizon, unit)
    per_replica = model.capacity(target.seconds)
    if unit is REQUESTS:
        slope = f"{model.per_unit * 1000:.1f}ms per request"
    else:
        slope = f"{model.per_unit * 1e6:.1f}ms per 1000 {unit.name}"
    fits = f"{target.describe()} {model.idle * 1000:.0f}ms + {slope}"
    goal = f"the {target.seconds * 1000:.0f}ms target"
    current = _mean_or_none(unit.demand(s) for s in recent) or 0.0
    refused = _mean(s.refused_share for s in recent) if recent else 0.0
    with_refused = f" with the {refused:.0%} the gateway refused" if refused > 0 else ""
    demand = f"demand {current:.1f} {unit.name}{with_refused}, {forecast:.1f} forecast in {horizon:g}s"
    demand += _waiting_noted(stable, target)
    if per_replica <= 0:
        why = f"{fits}: no replica meets {goal} (idle latency above it)"
        return policy.max_replicas, f"slo: {why}; {demand}", target.latency
    why = f"{fits}: {per_replica:.1f} {unit.name} per replica within {goal}"
    return _ceil(forecast / per_replica), f"slo: {why}; {demand}", None


def _waiting_noted(samples: Sequence[MetricsSample], target: LatencyTarget) -> str:
    """What the reason says of the tail the gateway's queue took, where it took some."""
    held_to = _left_to_replicas(samples, target.latency, target.percentile)
    if held_to == target.percentile:
        return ""
    waits = Waits.over(samples)
    of = f"{waits.waited:.0f} of {waits.arrived:.0f} requests"
    return f"; {of} ({waits.share:.1%}) waited in the gateway, replicas held to p{held_to:.3g}"


def _most_wanted(
    targets: Sequence[Target], samples: Sequence[MetricsSample], window: int
) -> tuple[int, str] | None:
    """The most replicas any target's mean figure over `samples` wants, and why; None without figures."""
    best: tuple[int, str] | None = None
    for target in targets:
        mean = _mean_or_none(_figure(s, target.figure) for s in samples)
        if mean is None:
            continue
        wanted = _ceil(mean / target.per_replica)
        if best is None or wanted > best[0]:
            per_replica = f"target {target.per_replica:g} per replica"
            best = wanted, f"{target.figure} {mean:.1f} over the last {window}s, {per_replica}"
    return best


def _figure(sample: MetricsSample, figure: Figure) -> float | None:
    if figure == "queue depth":
        return sample.queue_depth
    if figure == "queued prompt tokens":
        return sample.queued_prompt_tokens
    return sample.kv_cache_in_use


def _latency(sample: MetricsSample, latency: Latency, percentile: float | None = None) -> float | None:
    """The sample's latency: its mean, or at the percentile of its histogram (None where the replicas
    export no buckets: a mean says nothing of a tail)."""
    ttft = latency == "time to first token"
    if percentile is None:
        return sample.ttft_seconds if ttft else sample.itl_seconds
    buckets = sample.ttft_buckets if ttft else sample.itl_buckets
    return histogram_quantile(percentile / 100, buckets) if buckets is not None else None


def _latency_floor(
    wanted: int, reason: str, fleet: FleetState, observed: float, target: LatencyTarget
) -> tuple[int, str]:
    """Latency is missed: never shrink; with every replica up, add one and wait for it before the next."""
    current = fleet.current_replicas
    latency = f"mean {target.latency} {observed * 1000:.0f}ms over the {target.seconds * 1000:.0f}ms target"
    if wanted <= current and fleet.ready_replicas >= current:
        return current + 1, latency
    if wanted < current:
        return current, latency
    return wanted, reason


def _stepped(
    policy: ScalingSpec,
    fleet: FleetState,
    wanted: int,
    reason: str,
    recommendations: Sequence[tuple[float, int]],
) -> tuple[int, str]:
    """`wanted` within one decision's steps: down only to the most wanted over the scale-down delay, up
    only while every replica can be scheduled."""
    current, replicas = fleet.current_replicas, wanted
    if replicas < current:
        held = max(count for _, count in recommendations)
        if held > replicas:
            replicas = min(held, current)
            reason += f"; scale-down delayed ({held} wanted within {policy.scale_down_delay_seconds}s)"
        replicas = max(replicas, current - policy.scale_down_step(current))
    elif replicas > current:
        if fleet.unschedulable_replicas > 0:
            replicas = current
            reason += f"; holding: {fleet.unschedulable_replicas} replica(s) cannot be scheduled"
        else:
            replicas = min(replicas, current + policy.scale_up_step(current))
    return replicas, reason


def _scale_to_zero(policy: ScalingSpec, reason: str, idle_for: float) -> tuple[int, str]:
    """The last replica goes only after a whole idle period: the next request would wait for a cold start."""
    if idle_for < policy.scale_to_zero_after_seconds:
        waiting = f"idle {idle_for:.0f}s of the {policy.scale_to_zero_after_seconds}s before scaling to zero"
        return 1, f"{reason}; {waiting}"
    return 0, f"idle for {idle_for:.0f}s: scaled to zero"


def _bounded_reason(replicas: int, unbounded: int, reason: str) -> str:
    if replicas > unbounded:
        return f"{reason}; raised to the minimum of {replicas}"
    if replicas < unbounded:
        return f"{reason}; capped at the maximum of {replicas}"
    return reason


def _ceil(value: float) -> int:
    return math.ceil(value - _CEIL_EPSILON)


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)


def _mean_or_none(values: Iterable[float | None]) -> float | None:
    items = [value for value in values if value is not None]
    return sum(items) / len(items) if items else None
