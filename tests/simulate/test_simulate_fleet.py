"""The fleet simulation: a tiny trace's report worked out by hand, the operator's and the gateway's own code
deciding, and memory that follows the requests in flight rather than the trace."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import replace
from typing import Any

import pytest
from kvfleet.gateway import routing
from kvfleet.operator import autoscaler

from kvfleet.simulate import fleet, operator_loop
from kvfleet.simulate.engine import EngineModel, EngineProfile
from kvfleet.simulate.fleet import Simulation, load_config
from kvfleet.simulate.report import Histogram, RunReport, ScaleEvent, bucket_of
from kvfleet.simulate.trace import TraceRequest, TraceShapeSpec, generate

PROFILE = EngineProfile(step_fixed_s=0.010, prefill_token_s=0.001, decode_sequence_s=0.002)


def _service(scaling: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {"model": {"uri": "hf://org/model"}, "scaling": scaling, **sections}


def test_a_tiny_trace_reports_what_hand_computation_gives() -> None:
    # One replica running one request at a time, and a gateway queue of one place: of three requests at
    # once, the first runs, the second waits for it, the third is shed (it displaces no one of its tier).
    service = _service(
        {"minReplicas": 1, "maxReplicas": 1, "metricsIntervalSeconds": 2}, engine={"maxNumSeqs": 1}
    )
    config = load_config(service, PROFILE, ttft_target_s=0.03, max_queue=1)
    summary = Simulation(config).run([TraceRequest(0.0, 10, 1) for _ in range(3)])
    # Each request is one 10 + 10 ms step: first tokens at 20 and 40 ms.
    assert summary["requests"] == 3 and summary["shed"] == 1 and summary["waited"] == 1
    assert summary["attainment"] == pytest.approx(1 / 3)
    assert summary["ttft_p50_s"] == pytest.approx(0.020, rel=0.01)
    assert summary["ttft_p90_s"] == pytest.approx(0.040, rel=0.01)
    # The run ends at the first scrape that finds nothing left to do: one replica for 2 s.
    assert summary["simulated_seconds"] == 2
    assert summary["replica_hours"] == pytest.approx(2 / 3600)
    assert summary["scale_events"] == summary["flaps"] == 0


def test_a_step_that_ends_when_a_request_arrives_frees_its_place_first() -> None:
    # One place, no queue: the second request, arriving as the first one's only step ends, finds the place
    # free only if the step's end is handled before its arrival; otherwise it is shed.
    service = _service({"replicas": 1}, engine={"maxNumSeqs": 1})
    config = load_config(service, PROFILE, ttft_target_s=1.0, max_queue=0)
    step = PROFILE.step_seconds(10, 0, 0)
    summary = Simulation(config).run([TraceRequest(0.0, 10, 1), TraceRequest(step, 10, 1)])
    assert summary["shed"] == 0 and summary["attainment"] == 1.0
    assert summary["ttft_p90_s"] == pytest.approx(step, rel=0.01)


@pytest.fixture
def first_tokens(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every time to first token the simulation reports, in order."""
    seen: list[float] = []
    first_token = RunReport.first_token
    monkeypatch.setattr(
        RunReport,
        "first_token",
        lambda report, tier, seconds: (seen.append(seconds), first_token(report, tier, seconds)),
    )
    return seen


def test_a_first_token_beside_a_decoding_sequence_or_after_an_idle_gap_waits_what_the_profile_says(
    first_tokens: list[float],
) -> None:
    profile = replace(
        PROFILE,
        first_token_overhead_s=0.003,
        first_token_overhead_per_sequence_s=0.007,
        wake_s=0.05,
        wake_after_s=1.0,
    )
    config = load_config(_service({"replicas": 1}, engine={"maxNumSeqs": 2}), profile, ttft_target_s=1.0)
    # A, at 0 on a replica that never ran: reaches the engine 3 ms later, then a 10 + 10 ms step and the
    # whole wake, 0.073; then decode steps of 12 ms, the 37th ending at 0.517 and its last (61 after the one
    # it shares with B) at 1.271.
    # B, at 0.5, beside A: reaches the engine at 0.510 (3 ms, and 7 for the sequence beside), waits for the
    # step in progress, then 10 + 10 + 2 ms: 0.539.
    # C, at 2.268: reaches the engine a second after A ended, then a 20 ms step and the wake of that second.
    trace = [TraceRequest(0.0, 10, 100), TraceRequest(0.5, 10, 1), TraceRequest(2.268, 10, 1)]
    Simulation(config).run(trace)
    wake_after_a_second = 0.05 * (1 - math.exp(-1))
    expected = [0.073, 0.539 - 0.5, 0.003 + 0.020 + wake_after_a_second]
    assert first_tokens == pytest.approx(expected)


def test_a_request_holds_its_place_in_the_gateway_on_its_way_in(first_tokens: list[float]) -> None:
    # One place, and a way in of 50 ms: the second request of two sent together is routed when the first's
    # stream ends (0.05 + 0.02), and reaches the engine 50 ms later.
    profile = replace(PROFILE, first_token_overhead_s=0.05)
    config = load_config(_service({"replicas": 1}, engine={"maxNumSeqs": 1}), profile, ttft_target_s=1.0)
    Simulation(config).run([TraceRequest(0.0, 10, 1), TraceRequest(0.0, 10, 1)])
    assert first_tokens == pytest.approx([0.07, 0.14])


def test_the_operators_autoscaler_and_the_gateways_policy_are_the_ones_called(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert operator_loop.decide is autoscaler.decide and operator_loop.aggregate is autoscaler.aggregate
    decisions: list[autoscaler.ScaleDecision] = []

    def spied(*args: Any, **kwargs: Any) -> autoscaler.ScaleDecision:
        decisions.append(autoscaler.decide(*args, **kwargs))
        return decisions[-1]

    monkeypatch.setattr(operator_loop, "decide", spied)
    service = _service(
        {"minReplicas": 1, "maxReplicas": 6, "targetQueueDepth": 4, "stableWindowSeconds": 20},
        routing={"policy": "prefix-hash"},
        sla={"ttftTargetMilliseconds": 500},
    )
    simulation = Simulation(load_config(service, PROFILE, pod_start_s=5))
    assert isinstance(simulation.policy, routing.PrefixHash)
    trace = generate(TraceShapeSpec("steady", duration_s=60, base_rate=20, mean_output_tokens=200))
    summary = simulation.run(trace)
    # 20 requests a second of about 200 tokens at 10 ms + 2 ms per sequence a step hold many more than four
    # requests in flight: the autoscaler grows the fleet, and says why in its own words.
    assert decisions and summary["scale_events"] >= 1
    grown = summary["scale_event_log"][0]
    assert grown["to_replicas"] > grown["from_replicas"]
    assert "queue depth" in grown["reason"] and grown["reason"] == next(
        decision.reason for decision in decisions if decision.replicas > 1
    )
    assert summary["peak_replicas"] > 1


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin() -> None:
    trace = list(generate(TraceShapeSpec("steady", duration_s=30, base_rate=10, prefix_groups=16)))
    rates = {}
    for policy in ("round-robin", "prefix-hash"):
        service = _service({"replicas": 4}, routing={"policy": policy})
        # Each replica's cache holds 8 of the 16 groups' shared tokens: where a group goes matters.
        profile = EngineProfile(kv_cache_tokens=2048)
        summary = Simulation(load_config(service, profile, ttft_target_s=1.0)).run(trace)
        rates[policy] = summary["prefix_cache_hit_rate"]
    assert rates["prefix-hash"] > rates["round-robin"] + 0.2


def _peak_memory(duration_s: float) -> tuple[int, int]:
    """The peak of memory allocated while a steady trace is replayed, and of requests in flight."""
    # The autoscaler keeps a stable window of samples (each with the interval's latency histograms): a short
    # one is full within either trace.
    service = _service({"replicas": 2, "stableWindowSeconds": 10})
    # The default profile's replicas keep up with 20 requests a second: few are ever in flight.
    config = load_config(service, EngineProfile(), ttft_target_s=1.0, series_interval_s=1e9)
    simulation = Simulation(config)
    tracemalloc.start()
    try:
        simulation.run(generate(TraceShapeSpec("steady", duration_s, base_rate=20, mean_output_tokens=8)))
        return tracemalloc.get_traced_memory()[1], simulation.peak_in_flight
    finally:
        tracemalloc.stop()


def test_memory_follows_the_requests_in_flight_not_the_trace() -> None:
    (short, short_in_flight), (long, long_in_flight) = _peak_memory(20), _peak_memory(100)
    # Five times the trace (about 400 and 2,000 requests) at the same rate and about as many in flight: the
    # peak barely moves.
    assert long_in_flight < 2 * short_in_flight
    assert long < 1.5 * short


def test_a_percentile_is_read_back_within_one_percent() -> None:
    histogram = Histogram()
    values = [0.001 * 1.37**index for index in range(40)]
    for value in values:
        histogram.add(bucket_of(value))
    for share in (0.5, 0.9, 0.99):
        exact = sorted(values)[max(0, -(-int(share * 100) * len(values) // 100) - 1)]
        assert histogram.percentile(share) == pytest.approx(exact, rel=0.01)


def test_a_fall_within_the_stable_window_of_a_rise_is_a_flap() -> None:
    report = RunReport(ttft_target_s=1.0, stable_window_s=60)
    report.scaled(ScaleEvent(0, 2, 3, "up"))
    report.scaled(ScaleEvent(30, 3, 2, "down"))
    report.scaled(ScaleEvent(100, 2, 3, "up"))
    report.scaled(ScaleEvent(200, 3, 2, "down"))
    assert report.flaps == 1


def test_a_disaggregated_service_is_refused_not_simulated_as_another() -> None:
    service = _service({}, sla={"ttftTargetMilliseconds": 500}, disaggregation={})
    with pytest.raises(ValueError, match=r"spec\.disaggregation is not simulated"):
        load_config(service, PROFILE)


class _CountedEngine(EngineModel):
    """The engine model, counting the step events it starts."""

    events = 0

    def start_step(self, now: float) -> float | None:
        length = super().start_step(now)
        _CountedEngine.events += length is not None
        return length


class _StepByStepEngine(_CountedEngine):
    """The engine model with every run of decode steps cut to its first step: one event per step."""

    def start_step(self, now: float) -> float | None:
        length = super().start_step(now)
        if length is None:
            return None
        cut = self.interrupt(now)
        return length if cut is None else cut - now


def test_runs_of_decode_steps_give_what_stepping_one_step_at_a_time_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An autoscaled fleet whose KV cache preempts and whose steps grow with their context: the same TTFTs and
    # the same replica counts over time whether a replica's decode steps are one event or one each.
    profile = replace(PROFILE, context_token_s=1e-5, kv_cache_tokens=3000)
    service = _service(
        {"policy": "slo", "minReplicas": 1, "maxReplicas": 8, "metricsIntervalSeconds": 2},
        sla={"ttftTargetMilliseconds": 300},
    )
    trace = list(generate(TraceShapeSpec("burst", 60, base_rate=4, burst_start_s=20, burst_length_s=10)))
    summaries, events = {}, {}
    for engine in (_CountedEngine, _StepByStepEngine):
        monkeypatch.setattr(fleet, "EngineModel", engine)
        _CountedEngine.events = 0
        summaries[engine] = Simulation(load_config(service, profile, pod_start_s=5)).run(trace)
        events[engine] = _CountedEngine.events
    runs, steps = summaries[_CountedEngine], summaries[_StepByStepEngine]
    assert events[_CountedEngine] < events[_StepByStepEngine] / 2
    assert runs["preemptions"] > 0 and runs["scale_events"] > 0
    # Equal up to the rounding of a run's length summed at once rather than step by step.
    for figure in ("attainment", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "replica_hours"):
        assert runs[figure] == pytest.approx(steps[figure], rel=1e-9), figure
    assert [(p["running"], p["ready"]) for p in runs["series"]] == [
        (p["running"], p["ready"]) for p in steps["series"]
    ]
    assert runs["scale_event_log"] == steps["scale_event_log"]
