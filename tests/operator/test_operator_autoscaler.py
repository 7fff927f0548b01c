"""The autoscaler's decision function, driven by a fake clock and simulated fleets."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from kvfleet.contract.kv_transfer import Role
from kvfleet.operator.autoscaler import (
    AutoscalerState,
    FleetState,
    LatencyTarget,
    MetricsSample,
    PodMetrics,
    ScaleDecision,
    Target,
    aggregate,
    decide,
    sizing,
)
from kvfleet.operator.spec import ScalingSpec, parse_spec

POLICY = ScalingSpec(
    min_replicas=1,
    max_replicas=10,
    target_queue_depth=10,
    stable_window_seconds=60,
    panic_window_seconds=6,
    panic_threshold_percent=200,
    scale_down_delay_seconds=120,
    max_scale_up_step=4,
    max_scale_down_step=1,
    metrics_interval_seconds=2,
)


@dataclass
class SimulatedFleet:
    """Replicas become ready `startup_seconds` after they are asked for; demand is a function of time."""

    policy: ScalingSpec
    demand: Callable[[float], float]
    replicas: int = 1
    startup_seconds: float = 0.0
    gpu_capacity: int | None = None
    now: float = 0.0
    samples: list[MetricsSample] = field(default_factory=list)
    state: AutoscalerState = field(default_factory=AutoscalerState)
    history: list[int] = field(default_factory=list)
    decisions: list[ScaleDecision] = field(default_factory=list)
    _asked_at: dict[int, float] = field(default_factory=dict)

    def ready(self) -> int:
        placed = self.replicas if self.gpu_capacity is None else min(self.replicas, self.gpu_capacity)
        return sum(
            1 for index in range(placed) if self.now - self._asked_at.get(index, -1e9) >= self.startup_seconds
        )

    def tick(self) -> ScaleDecision:
        ready = self.ready()
        per_pod = self.demand(self.now) / max(ready, 1)
        reports = [PodMetrics(waiting=per_pod / 2, running=per_pod / 2) for _ in range(ready)]
        sample = aggregate(self.now, reports, ready)
        if sample is not None:
            self.samples.append(sample)
        unschedulable = 0 if self.gpu_capacity is None else max(0, self.replicas - self.gpu_capacity)
        fleet = FleetState(self.replicas, ready, unschedulable)
        decision = decide(self.policy, self.samples, fleet, self.state, self.now)
        for index in range(self.replicas, decision.replicas):
            self._asked_at[index] = self.now
        self.replicas, self.state = decision.replicas, decision.state
        self.history.append(self.replicas)
        self.decisions.append(decision)
        self.now += self.policy.metrics_interval_seconds
        return decision

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.tick()


def direction_changes(history: list[int]) -> int:
    steps = [b - a for a, b in itertools.pairwise(history) if b != a]
    return sum(1 for a, b in itertools.pairwise(steps) if (a > 0) != (b > 0))


def test_steady_load_holds_the_right_count() -> None:
    fleet = SimulatedFleet(POLICY, demand=lambda t: 35.0, replicas=4)
    fleet.run(600)
    assert set(fleet.history) == {4}
    assert fleet.decisions[-1].panic is False


def test_steady_load_from_minimum_settles_without_overshoot() -> None:
    fleet = SimulatedFleet(POLICY, demand=lambda t: 35.0, replicas=1, startup_seconds=20)
    fleet.run(900)
    assert fleet.history[-1] == 4
    assert max(fleet.history) <= 4 + POLICY.max_scale_up_step
    assert fleet.history[-150:] == [4] * 150


def test_burst_enters_panic_and_scales_up_within_seconds() -> None:
    fleet = SimulatedFleet(POLICY, demand=lambda t: 0.0 if t < 100 else 95.0, replicas=1, startup_seconds=30)
    fleet.run(100)
    assert set(fleet.history) == {1}
    first = fleet.tick()
    assert first.panic and "panic" in first.reason
    assert 1 < first.replicas <= 1 + POLICY.max_scale_up_step
    fleet.run(POLICY.panic_window_seconds)
    assert fleet.replicas >= 1 + POLICY.max_scale_up_step, "the panic window sees the burst within seconds"
    steps = [b - a for a, b in itertools.pairwise(fleet.history)]
    assert max(steps) <= POLICY.max_scale_up_step
    fleet.run(60)
    assert fleet.replicas == 10
    assert max(fleet.history) == 10


def test_no_scale_down_during_panic() -> None:
    demand = {"value": 100.0}
    fleet = SimulatedFleet(POLICY, demand=lambda t: demand["value"], replicas=2)
    fleet.tick()
    assert fleet.decisions[-1].panic
    peak = fleet.replicas
    demand["value"] = 0.0
    fleet.run(POLICY.stable_window_seconds - 4)
    assert all(decision.panic for decision in fleet.decisions)
    assert min(fleet.history[1:]) >= peak


def test_scale_down_waits_for_the_delay_then_steps_down() -> None:
    policy = ScalingSpec(**{**POLICY.__dict__, "scale_down_delay_seconds": 120})
    fleet = SimulatedFleet(policy, demand=lambda t: 60.0 if t < 300 else 0.0, replicas=6)
    fleet.run(300)
    assert fleet.replicas == 6
    fleet.run(policy.scale_down_delay_seconds - 2)
    assert fleet.replicas == 6, "nothing shrinks inside the scale-down delay"
    fleet.run(20)
    assert fleet.replicas < 6
    descent = fleet.history[fleet.history.index(5) - 1 :]
    assert all(a - b <= policy.max_scale_down_step for a, b in itertools.pairwise(descent))
    delayed = fleet.decisions[150 : fleet.history.index(5)]
    assert delayed and all("scale-down delayed (6 wanted" in d.reason for d in delayed[5:])
    fleet.run(300)
    assert fleet.replicas == policy.min_replicas


def test_flapping_load_does_not_oscillate() -> None:
    # Demand alternating between about 4 and 9 replicas' worth every 20 s.
    fleet = SimulatedFleet(POLICY, demand=lambda t: 40.0 if int(t // 20) % 2 else 85.0, replicas=4)
    fleet.run(1800)
    settled = fleet.history[len(fleet.history) // 3 :]
    assert direction_changes(settled) == 0
    assert len(set(settled)) == 1


def test_missing_reports_neither_block_nor_count_as_idle() -> None:
    reports = [PodMetrics(10, 20), None, PodMetrics(20, 10), None]
    sample = aggregate(5.0, reports, ready_replicas=4)
    assert sample is not None
    assert sample.queue_depth == 120.0, "silent replicas are assumed as busy as the average"
    assert sample.reporting_pods == 2
    assert aggregate(5.0, [None, None], ready_replicas=2) is None


def test_no_metrics_holds_the_current_count() -> None:
    decision = decide(POLICY, [], FleetState(3, 0), AutoscalerState(), now=100.0)
    assert decision.replicas == 3 and "no metrics" in decision.reason
    stale = [MetricsSample(time=10.0, queue_depth=500.0, reporting_pods=1)]
    assert decide(POLICY, stale, FleetState(3, 3), AutoscalerState(), now=100.0).replicas == 3


def test_a_large_fleet_steps_by_a_share_of_itself() -> None:
    large = dataclasses.replace(
        POLICY, max_replicas=1000, max_scale_up_percent=100, max_scale_down_percent=10
    )
    # 20,000 requests at 10 a replica want 2,000; a decision adds the step of 4 or 100% of 200, the more.
    up = decide(large, [MetricsSample(0, 20000, 200)], FleetState(200, 200), AutoscalerState(), 0)
    assert up.replicas == 400
    # Wanting 10, with nothing else wanted over the scale-down delay: 10% of 400 at once, not 1.
    quiet = AutoscalerState(recommendations=((0, 10),))
    down = decide(large, [MetricsSample(200, 100, 400)], FleetState(400, 400), quiet, 200)
    assert down.replicas == 360
    # Below 10 replicas the share is less than one, and the step of 1 stands.
    assert decide(large, [MetricsSample(200, 10, 8)], FleetState(8, 8), quiet, 200).replicas == 7


def test_unschedulable_replicas_hold_scale_up() -> None:
    fleet = SimulatedFleet(POLICY, demand=lambda t: 200.0, replicas=2, gpu_capacity=3)
    fleet.run(300)
    assert fleet.replicas <= 3 + POLICY.max_scale_up_step
    stuck = fleet.replicas
    fleet.run(300)
    assert fleet.replicas == stuck, "no more replicas while some cannot be placed"
    assert "cannot be scheduled" in fleet.decisions[-1].reason


def test_a_first_decision_holds_the_deployments_count_over_the_scale_down_delay() -> None:
    # 10 requests on the fleet want one replica at 10 a replica; the Deployment has 4.
    samples = [MetricsSample(time=t, queue_depth=10.0, reporting_pods=4) for t in range(0, 200, 2)]
    state, replicas = AutoscalerState(), 4
    for now in range(60, 180, 2):
        decision = decide(POLICY, samples, FleetState(replicas, replicas), state, float(now))
        replicas, state = decision.replicas, decision.state
        assert replicas == 4, f"shrunk at {now}s, within 120s of the first decision at 60s"
    assert "scale-down delayed (4 wanted within 120s)" in decision.reason
    # 120 s after the first decision its count no longer holds: one replica down per decision.
    assert decide(POLICY, samples, FleetState(4, 4), state, 180.0).replicas == 3


def test_unschedulable_replicas_do_not_block_scale_down() -> None:
    samples = [MetricsSample(time=t, queue_depth=0.0, reporting_pods=2) for t in range(0, 400, 2)]
    state = AutoscalerState()
    replicas = 6
    # The first decision holds the 6 the Deployment has over the scale-down delay, then the fleet shrinks.
    for now in range(200, 400, 2):
        decision = decide(POLICY, samples, FleetState(replicas, 2, 4), state, float(now))
        replicas, state = decision.replicas, decision.state
    assert replicas < 6


def test_bounds_are_respected() -> None:
    policy = ScalingSpec(**{**POLICY.__dict__, "min_replicas": 2, "max_replicas": 3})
    busy = SimulatedFleet(policy, demand=lambda t: 1000.0, replicas=2)
    busy.run(300)
    assert max(busy.history) == 3
    assert "capped at the maximum" in busy.decisions[-1].reason
    idle = SimulatedFleet(policy, demand=lambda t: 0.0, replicas=3)
    idle.run(600)
    assert idle.replicas == 2 and min(idle.history) == 2
    below = decide(policy, [], FleetState(1, 1), AutoscalerState(), now=0.0)
    assert below.replicas == 2 and "minimum" in below.reason


def test_panic_threshold_is_relative_to_ready_replicas() -> None:
    samples = [MetricsSample(time=t, queue_depth=70.0, reporting_pods=4) for t in range(50, 62, 2)]
    # 7 wanted against 4 ready: 175% is under the 200% threshold, so this is ordinary scaling.
    calm = decide(POLICY, samples, FleetState(4, 4), AutoscalerState(), now=61.0)
    assert not calm.panic and calm.replicas == 7
    hot = decide(POLICY, samples, FleetState(4, 3), AutoscalerState(), now=61.0)
    assert hot.panic


TTFT_TARGET = LatencyTarget("time to first token", 0.5)
# An autoscaler that has decided before, long enough ago that nothing it wanted still delays a scale-down.
SETTLED = AutoscalerState(recommendations=((-1000.0, 1),))


def test_ttft_over_target_adds_one_replica_at_a_time() -> None:
    samples = [
        MetricsSample(time=t, queue_depth=10.0, reporting_pods=2, ttft_seconds=0.9) for t in range(0, 60, 2)
    ]
    decision = decide(POLICY, samples, FleetState(2, 2), AutoscalerState(), now=59.0, latency=TTFT_TARGET)
    assert decision.replicas == 3 and "time to first token" in decision.reason
    starting = decide(POLICY, samples, FleetState(3, 2), AutoscalerState(), now=59.0, latency=TTFT_TARGET)
    assert starting.replicas == 3, "waits for the added replica before adding another"
    met = decide(
        POLICY,
        samples,
        FleetState(2, 2),
        SETTLED,
        now=59.0,
        latency=LatencyTarget("time to first token", 1.0),
    )
    assert met.replicas == 1 and "time to first token" not in met.reason, "a met target leaves queue scaling"


ZERO = ScalingSpec(min_replicas=0, max_replicas=4, target_queue_depth=10, scale_to_zero_after_seconds=300)


def run_decisions(
    policy: ScalingSpec, demand: Callable[[float], float], replicas: int, until: float, step: float = 2.0
) -> list[tuple[float, ScaleDecision]]:
    """Decisions every `step` seconds with the given fleet demand (replicas ready at once)."""
    samples: list[MetricsSample] = []
    state = AutoscalerState()
    decisions = []
    now = 0.0
    while now <= until:
        samples = [s for s in samples if now - s.time < policy.stable_window_seconds]
        samples.append(MetricsSample(now, demand(now), max(replicas, 1)))
        decision = decide(policy, samples, FleetState(replicas, replicas), state, now)
        state, replicas = decision.state, decision.replicas
        decisions.append((now, decision))
        now += step
    return decisions


def test_an_idle_fleet_scales_to_zero_only_after_the_idle_period() -> None:
    decisions = run_decisions(ZERO, lambda now: 5.0 if now < 100 else 0.0, replicas=1, until=700)
    zero_at = next(now for now, decision in decisions if decision.replicas == 0)
    # Idle from 100 s: not before 400 s, and at the first decision after it.
    assert 400 <= zero_at < 404
    (_, first_zero) = next((now, d) for now, d in decisions if d.replicas == 0)
    assert "scaled to zero" in first_zero.reason
    assert all(decision.replicas == 0 for now, decision in decisions if now >= zero_at)


def test_demand_during_the_idle_period_starts_it_again() -> None:
    def demand(now: float) -> float:
        return 1.0 if 200 <= now < 202 else 0.0

    decisions = run_decisions(ZERO, demand, replicas=1, until=600)
    zero_at = next(now for now, decision in decisions if decision.replicas == 0)
    assert zero_at >= 502, "idle since 202 s, not since 0 s"


def test_held_requests_scale_a_fleet_at_zero_to_one() -> None:
    samples = [MetricsSample(float(t), 0.0, 0) for t in range(0, 58, 2)] + [MetricsSample(58.0, 1.0, 0)]
    decision = decide(ZERO, samples, FleetState(0, 0), AutoscalerState(idle_since=0.0), 58.0)
    assert decision.replicas == 1
    assert decision.state.idle_since is None
    idle = decide(ZERO, samples[:-1], FleetState(0, 0), AutoscalerState(idle_since=0.0), 56.0)
    assert idle.replicas == 0


def test_the_gateway_queue_adds_to_the_replicas_demand() -> None:
    sample = aggregate(0.0, [PodMetrics(waiting=2, running=3), None], 2, held=7.0)
    assert sample is not None and sample.queue_depth == 2 * 5 + 7
    assert aggregate(0.0, [None], 1, held=7.0) is None, "no replica answered: no sample from the replicas"


# A disaggregated service: the service's windows and steps, each role's bounds and targets.
ROLES_SPEC = parse_spec(
    {
        "model": {"uri": "file:///m"},
        "scaling": {"stableWindowSeconds": 60, "panicWindowSeconds": 6, "scaleDownDelaySeconds": 120},
        "sla": {"ttftTargetMilliseconds": 500},
        "disaggregation": {
            "prefill": {"scaling": {"minReplicas": 0, "maxReplicas": 6, "targetQueuedPromptTokens": 4000}},
            "decode": {
                "scaling": {
                    "maxReplicas": 8,
                    "targetQueueDepth": 16,
                    "targetKvCacheUsagePercent": 80,
                    "itlTargetMilliseconds": 50,
                }
            },
        },
    },
    name="svc",
)


def steady(reports: list[PodMetrics], until: float = 60.0) -> list[MetricsSample]:
    """The same replicas' reports every 2 s over a window."""
    samples = []
    for now in range(0, int(until), 2):
        sample = aggregate(float(now), reports, len(reports))
        assert sample is not None
        samples.append(sample)
    return samples


def decide_role(role: Role, samples: list[MetricsSample], replicas: int, now: float = 58.0) -> ScaleDecision:
    fit = sizing(ROLES_SPEC, role)
    fleet = FleetState(replicas, replicas)
    return decide(fit.policy, samples, fleet, SETTLED, now, fit.latency, fit.targets)


def test_each_role_is_sized_on_its_own_figures() -> None:
    prefill, decode = sizing(ROLES_SPEC, "prefill"), sizing(ROLES_SPEC, "decode")
    assert prefill.targets == (Target("queued prompt tokens", 4000),)
    assert prefill.latency == LatencyTarget("time to first token", 0.5)
    assert decode.targets == (Target("queue depth", 16), Target("KV cache in use", 0.8))
    assert decode.latency == LatencyTarget("inter-token latency", 0.05)
    assert (prefill.policy.min_replicas, prefill.policy.max_replicas) == (0, 6)
    assert (decode.policy.min_replicas, decode.policy.max_replicas) == (1, 8)
    assert prefill.policy.scale_down_delay_seconds == decode.policy.scale_down_delay_seconds == 120
    colocated = sizing(parse_spec({"model": {"uri": "file:///m"}}, name="svc"))
    assert colocated.targets == (Target("queue depth", 32),) and colocated.latency is None


def test_prefill_scales_on_queued_prompt_tokens_not_on_requests() -> None:
    # Two replicas each with 2 long prompts waiting: few requests, 2 x 9000 prompt tokens to compute.
    reports = [PodMetrics(waiting=2, running=1, queued_prompt_tokens=9000.0)] * 2
    decision = decide_role("prefill", steady(reports), replicas=2)
    assert decision.replicas == math.ceil(2 * 9000 / 4000)
    assert "queued prompt tokens 18000.0" in decision.reason and "target 4000 per replica" in decision.reason
    # The same requests with short prompts: one replica is enough (the scale-down delay aside).
    short = [PodMetrics(waiting=2, running=1, queued_prompt_tokens=300.0)] * 2
    assert decide_role("prefill", steady(short), replicas=1).replicas == 1


def test_a_replica_without_the_prompt_gauge_gives_the_prefill_role_no_metrics() -> None:
    decision = decide_role("prefill", steady([PodMetrics(waiting=5, running=5)]), replicas=2)
    assert decision.replicas == 2 and "no metrics" in decision.reason


def test_decode_takes_the_most_its_figures_want() -> None:
    # Few requests but their KV cache nearly full: the KV cache wants more than the queue depth does.
    crowded = [PodMetrics(waiting=0, running=6, kv_cache_usage=0.95)] * 2
    decision = decide_role("decode", steady(crowded), replicas=2)
    assert decision.replicas == math.ceil(2 * 0.95 / 0.8)
    assert decision.reason.startswith("KV cache in use 1.9 over the last 60s, target 0.8 per replica")
    # Many short requests with room in the cache: the queue depth wants more.
    busy = [PodMetrics(waiting=10, running=30, kv_cache_usage=0.3)] * 2
    decision = decide_role("decode", steady(busy), replicas=2)
    assert decision.replicas == math.ceil(2 * 40 / 16)
    assert decision.reason.startswith("panic: queue depth 80.0")


def test_decode_inter_token_latency_over_target_adds_one_replica() -> None:
    slow = [PodMetrics(waiting=0, running=8, kv_cache_usage=0.4, itl_seconds=0.09)] * 2
    decision = decide_role("decode", steady(slow), replicas=2)
    assert decision.replicas == 3
    assert "mean inter-token latency 90ms over the 50ms target" in decision.reason
    met = [PodMetrics(waiting=0, running=8, kv_cache_usage=0.4, itl_seconds=0.03)] * 2
    decision = decide_role("decode", steady(met), replicas=2)
    assert decision.replicas == 1 and "latency" not in decision.reason, "a met target leaves queue scaling"


def test_the_prefill_role_goes_to_zero_on_its_own_idle_period() -> None:
    fit = sizing(ROLES_SPEC, "prefill")
    samples: list[MetricsSample] = []
    state, replicas, now = AutoscalerState(), 1, 0.0
    history = []
    while now <= 600:
        tokens = 2000.0 if now < 100 else 0.0
        sample = aggregate(now, [PodMetrics(0, 1 if tokens else 0, queued_prompt_tokens=tokens)], 1)
        assert sample is not None
        samples = [s for s in samples if now - s.time < fit.policy.stable_window_seconds] + [sample]
        decision = decide(
            fit.policy, samples, FleetState(replicas, replicas), state, now, fit.latency, fit.targets
        )
        state, replicas = decision.state, decision.replicas
        history.append((now, replicas))
        now += 2
    zero_at = next(at for at, count in history if count == 0)
    assert 400 <= zero_at < 404, "idle from 100 s, gone after spec.scaling.scaleToZeroAfterSeconds"


def test_aggregate_estimates_the_fleets_prompt_backlog_and_kv_cache_in_use() -> None:
    reports = [
        PodMetrics(1, 2, kv_cache_usage=0.5, queued_prompt_tokens=1000.0, itl_seconds=0.02),
        None,
        PodMetrics(0, 1, kv_cache_usage=0.7, queued_prompt_tokens=3000.0, itl_seconds=0.04),
    ]
    sample = aggregate(0.0, reports, ready_replicas=3)
    assert sample is not None
    assert sample.queued_prompt_tokens == 2000.0 * 3, "the silent replica counts as the average"
    assert sample.kv_cache_in_use == pytest.approx(0.6 * 3)
    assert sample.itl_seconds == pytest.approx(0.03)
    assert aggregate(0.0, [PodMetrics(1, 1)], 1).queued_prompt_tokens is None  # type: ignore[union-attr]
