"""The autoscaler's decision: a pure function of the metric samples, the fleet's state and the clock.

Modelled on Knative's KPA: the desired count is the demand (requests running plus waiting, over the
replicas) divided by the target per replica, averaged over a stable window; a short panic window
reacts to bursts, and while it is active the fleet never shrinks. Scale-down waits for the highest
recommendation of a delay window (no flapping), steps are bounded, and replicas the scheduler cannot
place hold scale-up, so the fleet does not keep asking for GPUs that are not there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from kvfleet.operator.spec import ScalingSpec

# Keeps a float demand of exactly N targets from rounding up to N + 1.
_CEIL_EPSILON = 1e-9


@dataclass(frozen=True)
class PodMetrics:
    """What one ready replica reported in one scrape."""

    waiting: float
    running: float
    kv_cache_usage: float | None = None
    # Mean time to first token of the requests that started since the previous scrape, if any did.
    ttft_seconds: float | None = None

    @property
    def queue_depth(self) -> float:
        return self.waiting + self.running


@dataclass(frozen=True)
class MetricsSample:
    """The fleet's demand at one instant, estimated from the replicas that answered."""

    time: float
    queue_depth: float
    reporting_pods: int
    kv_cache_usage: float | None = None
    ttft_seconds: float | None = None


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


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str
    panic: bool
    state: AutoscalerState


def aggregate(
    time: float, reports: Sequence[PodMetrics | None], ready_replicas: int, held: float = 0.0
) -> MetricsSample | None:
    """One fleet sample from the ready replicas' reports and the requests the gateway holds for the service;
    None when no replica answered.

    A replica that failed to report is assumed as busy as the average of those that did: it neither
    blocks scaling nor counts as idle.
    """
    answered = [report for report in reports if report is not None]
    if not answered:
        return None
    mean_depth = sum(report.queue_depth for report in answered) / len(answered)
    replicas = max(ready_replicas, len(answered))
    kv = [report.kv_cache_usage for report in answered if report.kv_cache_usage is not None]
    ttft = [report.ttft_seconds for report in answered if report.ttft_seconds is not None]
    return MetricsSample(
        time=time,
        queue_depth=mean_depth * replicas + held,
        reporting_pods=len(answered),
        kv_cache_usage=sum(kv) / len(kv) if kv else None,
        ttft_seconds=sum(ttft) / len(ttft) if ttft else None,
    )


def decide(
    policy: ScalingSpec,
    samples: Sequence[MetricsSample],
    fleet: FleetState,
    state: AutoscalerState,
    now: float,
    ttft_target_seconds: float | None = None,
) -> ScaleDecision:
    """Replicas the fleet should have now, with the reason a user would want to read."""
    current = fleet.current_replicas
    stable = [s for s in samples if now - policy.stable_window_seconds < s.time <= now]
    if not stable:
        replicas = policy.clamp(current)
        return ScaleDecision(replicas, _bounded_reason(replicas, current, "no metrics yet"), False, state)

    panic_samples = [s for s in stable if now - policy.panic_window_seconds < s.time] or stable[-1:]
    wanted, reason, panic_until = _wanted_for_demand(policy, stable, panic_samples, fleet, state, now)
    panic = panic_until is not None
    ttft = _mean_or_none(s.ttft_seconds for s in panic_samples)
    panic_demand = _mean(s.queue_depth for s in panic_samples)
    if (
        ttft_target_seconds is not None
        and ttft is not None
        and ttft > ttft_target_seconds
        and panic_demand > 0
    ):
        wanted, reason = _latency_floor(wanted, reason, fleet, ttft, ttft_target_seconds)

    recent = [
        (time, count) for time, count in state.recommendations if now - time < policy.scale_down_delay_seconds
    ]
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
    return ScaleDecision(bounded, reason, panic, new_state)


def _wanted_for_demand(
    policy: ScalingSpec,
    stable: Sequence[MetricsSample],
    panic_samples: Sequence[MetricsSample],
    fleet: FleetState,
    state: AutoscalerState,
    now: float,
) -> tuple[int, str, float | None]:
    """Replicas the queue depth asks for, why, and until when panic mode lasts (None: not in panic).

    A burst on the short window that wants the panic threshold's share of the ready replicas starts panic
    mode, which lasts a stable window: meanwhile the fleet follows the short window and never shrinks.
    """
    current, target = fleet.current_replicas, policy.target_queue_depth
    stable_demand = _mean(s.queue_depth for s in stable)
    panic_demand = _mean(s.queue_depth for s in panic_samples)
    wanted_panic = _ceil(panic_demand / target)
    over_threshold = wanted_panic * 100 >= policy.panic_threshold_percent * max(fleet.ready_replicas, 1)
    panic_until = state.panic_until
    if over_threshold and wanted_panic > current:
        panic_until = now + policy.stable_window_seconds
    if panic_until is not None and now < panic_until:
        reason = f"panic: queue depth {panic_demand:.1f} over the last {policy.panic_window_seconds}s"
        return max(wanted_panic, current), f"{reason}, target {target} per replica", panic_until
    reason = f"queue depth {stable_demand:.1f} over the last {policy.stable_window_seconds}s"
    return _ceil(stable_demand / target), f"{reason}, target {target} per replica", None


def _latency_floor(
    wanted: int, reason: str, fleet: FleetState, ttft: float, ttft_target_seconds: float
) -> tuple[int, str]:
    """Latency is missed: never shrink; with every replica up, add one and wait for it before the next."""
    current = fleet.current_replicas
    latency = (
        f"mean time to first token {ttft * 1000:.0f}ms over the {ttft_target_seconds * 1000:.0f}ms target"
    )
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
        replicas = max(replicas, current - policy.max_scale_down_step)
    elif replicas > current:
        if fleet.unschedulable_replicas > 0:
            replicas = current
            reason += f"; holding: {fleet.unschedulable_replicas} replica(s) cannot be scheduled"
        else:
            replicas = min(replicas, current + policy.max_scale_up_step)
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
