"""The `slo` scaling policy against hand-computed cases: the latency model, the capacity at the target, the
demand forecast, and the bounds, steps and delays it shares with the queue-depth policy."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kvfleet.operator.api import API_VERSION, KIND
from kvfleet.operator.autoscaler import (
    AutoscalerState,
    FleetState,
    LatencyTarget,
    MetricsSample,
    decide,
    forecast_demand,
    latency_model,
    sizing,
)
from kvfleet.operator.spec import ScalingSpec, SpecError, parse_spec

POLICY = ScalingSpec(policy="slo", min_replicas=1, max_replicas=10, stable_window_seconds=60)
TTFT = LatencyTarget("time to first token", 0.6)


def _sample(time: float, queue_depth: float, ttft: float | None, pods: int = 2) -> MetricsSample:
    return MetricsSample(time=time, queue_depth=queue_depth, reporting_pods=pods, ttft_seconds=ttft)


# Two replicas holding 2 requests each answer in 300 ms; holding 4 each, in 500 ms.
RISING = [_sample(0, 4, 0.3), _sample(10, 8, 0.5)]


def test_the_latency_model_is_the_line_through_the_measurements() -> None:
    model = latency_model(RISING, "time to first token")
    assert model is not None
    # 100 ms more per request held, from 100 ms idle.
    assert model.idle == pytest.approx(0.1) and model.per_request == pytest.approx(0.1)
    # Within 600 ms: (600 - 100) / 100 = 5 requests per replica.
    assert model.capacity(0.6) == pytest.approx(5.0)
    # Within 2 s the line says 19, but it was measured at 4 at most: it is trusted up to 8.
    assert model.capacity(2.0) == pytest.approx(8.0)
    assert model.capacity(0.05) == 0.0


def test_requests_the_gateway_held_are_demand_but_not_the_replicas_load() -> None:
    # At 10 s the replicas hold 4 each, as before, and the gateway holds 6 more that neither had room for.
    held = [_sample(0, 4, 0.3), dataclasses.replace(_sample(10, 14, 0.5), held=6)]
    model = latency_model(held, "time to first token")
    assert model is not None
    assert (model.idle, model.per_request) == (pytest.approx(0.1), pytest.approx(0.1))
    # The line allows 5 within 600 ms, but a replica took no more than 4 while others waited.
    assert model.full_at == 4 and model.capacity(0.6) == pytest.approx(4.0)
    # The demand counts the held: 4 then 14, 1 a second more; 30 s after the latest, 14 + 30 = 44.
    assert forecast_demand(held, held[-1:], 30) == pytest.approx(44.0)


def test_a_load_that_never_varied_gives_a_line_through_the_origin() -> None:
    model = latency_model([_sample(0, 6, 0.3), _sample(2, 6, 0.5)], "time to first token")
    assert model is not None
    # 3 requests per replica at 400 ms on average: 133 ms per request.
    assert (model.idle, model.per_request) == (0.0, pytest.approx(0.4 / 3))
    assert latency_model([_sample(0, 0, 0.2), _sample(2, 6, None)], "time to first token") is None


def test_the_demand_forecast_follows_the_trend_and_never_falls_below_the_recent_demand() -> None:
    # 4 then 8 requests 10 s apart: 0.4 more a second; 30 s after the latest, 8 + 12 = 20.
    assert forecast_demand(RISING, RISING[-1:], 30) == pytest.approx(20.0)
    falling = [_sample(0, 8, 0.5), _sample(10, 4, 0.3)]
    assert forecast_demand(falling, falling[-1:], 30) == pytest.approx(4.0)
    assert forecast_demand(RISING[:1], RISING[:1], 30) == pytest.approx(4.0)


def test_the_fewest_replicas_that_meet_the_target_at_the_forecast_and_the_reason_names_the_numbers() -> None:
    decision = decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    # 20 requests forecast, 5 per replica within the target: 4 replicas.
    assert decision.replicas == 4 and not decision.panic
    assert decision.reason == (
        "slo: time to first token 100ms + 100.0ms per request: 5.0 requests per replica within the 600ms "
        "target; demand 8.0, 20.0 forecast in 30s"
    )


def test_the_bounds_and_steps_still_hold() -> None:
    capped = dataclasses.replace(POLICY, max_replicas=3)
    decision = decide(capped, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    assert decision.replicas == 3 and decision.reason.endswith("capped at the maximum of 3")
    stepped = dataclasses.replace(POLICY, max_scale_up_step=1)
    assert decide(stepped, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).replicas == 3


def test_a_target_below_the_idle_latency_asks_for_the_most_replicas_and_says_why() -> None:
    target = LatencyTarget("time to first token", 0.05)
    decision = decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[target])
    assert decision.replicas == 6  # the maximum of 10, four at a time
    assert "no replica meets the 50ms target" in decision.reason
    assert decision.unreachable == "time to first token"
    assert decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).unreachable is None


def test_a_fall_in_demand_waits_for_the_scale_down_delay() -> None:
    state = decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).state
    quiet = [_sample(40, 4, 0.3, pods=4), _sample(42, 4, 0.3, pods=4)]
    decision = decide(POLICY, quiet, FleetState(4, 4), state, 42, slo=[TTFT])
    # 4 requests, 1 per replica at 300 ms: one replica would do, but 4 were wanted 32 s ago.
    assert decision.replicas == 4 and "scale-down delayed (4 wanted within 120s)" in decision.reason


def test_without_a_latency_measured_under_load_the_queue_depth_decides() -> None:
    samples = [_sample(0, 40, None), _sample(2, 40, None)]
    decision = decide(POLICY, samples, FleetState(2, 2), AutoscalerState(), 2, slo=[TTFT])
    assert decision.reason.startswith("queue depth 40.0")


def _spec(sla: dict, disaggregated: bool = False) -> dict:
    spec = {"model": {"uri": "hf://org/model"}, "scaling": {"policy": "slo"}, "sla": sla}
    if disaggregated:
        spec["disaggregation"] = {"decode": {"scaling": {"itlTargetMilliseconds": 30}}}
    return spec


def test_the_slo_policy_without_a_latency_target_is_refused_with_a_clear_message() -> None:
    with pytest.raises(SpecError, match=r"policy slo sizes the fleet on latency targets: set spec\.sla"):
        parse_spec(_spec({}), name="chat")
    with pytest.raises(SpecError, match=r"spec\.scaling\.policy"):
        parse_spec({**_spec({"ttftTargetMilliseconds": 500}), "scaling": {"policy": "fastest"}}, name="chat")


def test_each_role_is_held_to_its_own_latency() -> None:
    colocated = parse_spec(_spec({"ttftTargetMilliseconds": 500, "itlTargetMilliseconds": 40}), name="chat")
    assert [target.latency for target in sizing(colocated).slo] == [
        "time to first token",
        "inter-token latency",
    ]
    assert sizing(colocated).policy.policy == "slo"
    split = parse_spec(_spec({"ttftTargetMilliseconds": 500}, disaggregated=True), name="chat")
    assert sizing(split, "prefill").slo == (LatencyTarget("time to first token", 0.5),)
    assert sizing(split, "decode").slo == (LatencyTarget("inter-token latency", 0.03),)
    assert parse_spec({"model": {"uri": "hf://org/model"}}, name="chat").scaling.policy == "queue-depth"


def test_the_api_server_refuses_the_slo_policy_without_a_latency_target(crd_validator: Any) -> None:
    def admitted(sla: dict) -> list[str]:
        resource = {"apiVersion": API_VERSION, "kind": KIND}
        _, errors = crd_validator.admit({**resource, "metadata": {"name": "chat"}, "spec": _spec(sla)})
        return errors

    assert any("scaling.policy slo sizes the fleet on latency targets" in error for error in admitted({}))
    assert admitted({"itlTargetMilliseconds": 40}) == []
