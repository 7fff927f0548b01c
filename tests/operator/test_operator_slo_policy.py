"""The `slo` scaling policy against hand-computed cases: the latency model, the capacity at the target, the
demand forecast, the percentile read from histograms, and the bounds, steps and delays it shares with the
queue-depth policy."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from typing import Any

import numpy as np
import pytest
from kvfleet.operator.api import API_VERSION, KIND
from kvfleet.operator.autoscaler import (
    THROUGHPUT,
    AutoscalerState,
    Buckets,
    FleetState,
    LatencyTarget,
    MetricsSample,
    PodMetrics,
    ScaleDecision,
    Waits,
    aggregate,
    decide,
    forecast_demand,
    histogram_quantile,
    latency_model,
    sizing,
)
from kvfleet.operator.spec import ScalingSpec, SpecError, parse_spec

POLICY = ScalingSpec(policy="slo", min_replicas=1, max_replicas=10, stable_window_seconds=60)
TTFT = LatencyTarget("time to first token", 0.6)
NO_WAITS = Waits()


def _sample(time: float, queue_depth: float, ttft: float | None, pods: int = 2) -> MetricsSample:
    return MetricsSample(time=time, queue_depth=queue_depth, reporting_pods=pods, ttft_seconds=ttft)


# Two replicas holding 2 requests each answer in 300 ms; holding 4 each, in 500 ms.
RISING = [_sample(0, 4, 0.3), _sample(10, 8, 0.5)]


def test_the_latency_model_is_the_line_through_the_measurements() -> None:
    model = latency_model(RISING, "time to first token")
    assert model is not None
    # 100 ms more per request held, from 100 ms idle.
    assert model.idle == pytest.approx(0.1) and model.per_unit == pytest.approx(0.1)
    # Within 600 ms: (600 - 100) / 100 = 5 requests per replica.
    assert model.capacity(0.6) == pytest.approx(5.0)
    # Within 2 s the line says 19, but it was measured at 4 at most: it is trusted up to 8.
    assert model.capacity(2.0) == pytest.approx(8.0)
    assert model.capacity(0.05) == 0.0


def test_requests_the_gateway_held_are_demand_but_not_the_replicas_load() -> None:
    # At 10 s the replicas hold 4 each, as before, and the gateway holds 6 more that neither had room for.
    held = [_sample(0, 4, 0.3), dataclasses.replace(_sample(10, 14, 0.5), held=6, waits=Waits(10, 5))]
    model = latency_model(held, "time to first token")
    assert model is not None
    assert (model.idle, model.per_unit) == (pytest.approx(0.1), pytest.approx(0.1))
    # The line allows 5 within 600 ms, but a replica took no more than 4 while others waited.
    assert model.full_at == 4 and model.capacity(0.6) == pytest.approx(4.0)
    # The demand counts the held: 4 then 14, 1 a second more; 30 s after the latest, 14 + 30 = 44.
    assert forecast_demand(held, held[-1:], 30) == pytest.approx(44.0)


def test_a_load_that_never_varied_gives_a_line_through_the_origin() -> None:
    model = latency_model([_sample(0, 6, 0.3), _sample(2, 6, 0.5)], "time to first token")
    assert model is not None
    # 3 requests per replica at 400 ms on average: 133 ms per request.
    assert (model.idle, model.per_unit) == (0.0, pytest.approx(0.4 / 3))
    assert latency_model([_sample(0, 0, 0.2), _sample(2, 6, None)], "time to first token") is None


def test_the_demand_forecast_follows_the_trend_and_never_falls_below_the_recent_demand() -> None:
    # 4 then 8 requests 10 s apart: 0.4 more a second; 30 s after the latest, 8 + 12 = 20.
    assert forecast_demand(RISING, RISING[-1:], 30) == pytest.approx(20.0)
    falling = [_sample(0, 8, 0.5), _sample(10, 4, 0.3)]
    assert forecast_demand(falling, falling[-1:], 30) == pytest.approx(4.0)
    assert forecast_demand(RISING[:1], RISING[:1], 30) == pytest.approx(4.0)


def test_a_trend_is_extended_at_the_low_end_of_its_slopes_interval() -> None:
    # A small fleet's counts of one and three requests in turn: the slope, 3/17.5 = 0.171 a second, is less
    # than twice its standard error (the residuals' 5.486 over 4 degrees of freedom and 17.5: 0.280). Extended
    # 32.5 s past the window's middle it would say 2 + 5.57; nothing of it is kept, and the window's mean, 2,
    # is the forecast.
    noise = [_sample(time, depth, 0.3) for time, depth in enumerate([1, 3, 1, 3, 1, 3])]
    assert forecast_demand(noise, noise[-2:], 30) == pytest.approx(2.0)
    # A ramp with a little scatter: slope 18.25/17.5 = 73/70, residuals 12/35, so a standard error of
    # sqrt(12/35 / 4 / 17.5) = sqrt(6)/35; the forecast is 3.75 + 32.5 x (73/70 - 2 sqrt(6)/35).
    ramp = [_sample(time, depth, 0.3) for time, depth in enumerate([1, 2.5, 3, 4.5, 5, 6.5])]
    expected = 3.75 + 32.5 * (73 / 70 - 2 * math.sqrt(6) / 35)
    assert forecast_demand(ramp, ramp[-2:], 30) == pytest.approx(expected)


def test_the_fewest_replicas_that_meet_the_target_at_the_forecast_and_the_reason_names_the_numbers() -> None:
    decision = decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    # 20 requests forecast, 5 per replica within the target: 4 replicas.
    assert decision.replicas == 4 and not decision.panic
    assert decision.reason == (
        "slo: time to first token mean 100ms + 100.0ms per request: 5.0 requests per replica within the "
        "600ms target; demand 8.0 requests, 20.0 forecast in 30s"
    )


def test_the_bounds_and_steps_still_hold() -> None:
    capped = dataclasses.replace(POLICY, max_replicas=3)
    decision = decide(capped, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    assert decision.replicas == 3 and decision.reason.endswith("capped at the maximum of 3")
    # One at a time: a step of 1 and no share of the fleet.
    stepped = dataclasses.replace(POLICY, max_scale_up_step=1, max_scale_up_percent=0)
    assert decide(stepped, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).replicas == 3
    # A step of 1 or 100% of the 2 asked for, whichever is more: 2 more.
    doubling = dataclasses.replace(POLICY, max_scale_up_step=1, max_scale_up_percent=100)
    assert decide(doubling, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).replicas == 4


def test_requests_the_gateway_refused_are_demand_that_nothing_else_shows() -> None:
    # RISING's demand, with the gateway refusing a quarter of the requests that reached it at 10 s: the
    # 8 requests held are three quarters of it, 8 / 0.75 = 10.67; the trend of 4 to 10.67 over 10 s is
    # 0.67 a second, so 30 s on 10.67 + 20 = 30.67 forecast, at 5 a replica: 7.
    refusing = [RISING[0], dataclasses.replace(RISING[1], refused_share=0.25)]
    decision = decide(POLICY, refusing, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    assert "demand 10.7 requests with the 25% the gateway refused, 30.7 forecast in 30s" in decision.reason
    assert decision.replicas == 6  # 2 + the step of 4
    # A gateway refusing nearly everything says the fleet is short, not by how much: at most ten times.
    swamped = [RISING[0], dataclasses.replace(RISING[1], refused_share=0.99)]
    assert (
        "demand 80.0 requests"
        in decide(POLICY, swamped, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).reason
    )


def test_a_gateway_that_refuses_has_its_held_requests_counted_once() -> None:
    prompt_tokens = THROUGHPUT["time to first token"]
    # The replicas serve 4000 prompt tokens/s with 8 requests, and the gateway holds 6 more: while it
    # refuses none, its queue is filling, and the demand is 4000 × 14 / 8 = 7000.
    filling = _token_sample(10, 14, 4000, 0.3, held=6)
    assert prompt_tokens.demand(filling) == pytest.approx(7000.0)
    # Refusing half of what reaches it, its queue is full and the replicas serve what it admits: 4000 /
    # (1 - 0.5) = 8000, not 7000 / (1 - 0.5).
    full = dataclasses.replace(filling, refused_share=0.5)
    assert prompt_tokens.demand(full) == pytest.approx(8000.0)


def test_a_target_below_the_idle_latency_asks_for_the_most_replicas_and_says_why() -> None:
    target = LatencyTarget("time to first token", 0.05)
    decision = decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[target])
    assert decision.replicas == 6  # the maximum of 10, four at a time
    assert "no replica meets the 50ms target" in decision.reason
    assert decision.unreachable == "time to first token"
    assert decide(POLICY, RISING, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).unreachable is None


def test_a_fleet_running_hot_is_not_told_its_target_is_unreachable_once_a_replica_has_met_it() -> None:
    # Two replicas at a steady 4100 then 3900 prompt tokens/s each answer in 750.5 then 749.5 ms: the line
    # through them is 730 ms + 5 ms per 1000 tokens/s, an idle replica above the 600 ms target.
    hot = [_token_sample(8, 8, 8200, 0.7505), _token_sample(10, 8, 7800, 0.7495)]
    never_met = decide(POLICY, hot, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    assert never_met.unreachable == "time to first token" and never_met.replicas == 6  # 10, four at a time
    # A replica was measured within the target at 3000 tokens/s before: the line says nothing of an idle
    # replica. In proportion to the load, 750 ms at 4000: 3200 within 600 ms; the demand 8000: 3 replicas.
    met = AutoscalerState(proven_throughput=(("time to first token", 3000.0),))
    decision = decide(POLICY, hot, FleetState(2, 2), met, 10, slo=[TTFT])
    assert decision.unreachable is None and decision.replicas == 3
    assert decision.reason.startswith(
        "slo: time to first token mean 0ms + 187.5ms per 1000 prompt tokens/s: 3200.0 prompt tokens/s per "
        "replica within the 600ms target; demand 8000.0 prompt tokens/s"
    )


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
    assert sizing(split, "prefill").slo == (LatencyTarget("time to first token", 0.5, 90),)
    assert sizing(split, "decode").slo == (LatencyTarget("inter-token latency", 0.03, 90),)
    assert parse_spec({"model": {"uri": "hf://org/model"}}, name="chat").scaling.policy == "queue-depth"


def test_the_api_server_refuses_the_slo_policy_without_a_latency_target(crd_validator: Any) -> None:
    def admitted(sla: dict) -> list[str]:
        resource = {"apiVersion": API_VERSION, "kind": KIND}
        _, errors = crd_validator.admit({**resource, "metadata": {"name": "chat"}, "spec": _spec(sla)})
        return errors

    assert any("scaling.policy slo sizes the fleet on latency targets" in error for error in admitted({}))
    assert admitted({"itlTargetMilliseconds": 40}) == []


INF = math.inf
# Ten observations: 2 up to 100 ms, 6 more up to 200 ms, 2 more up to 400 ms.
TEN = ((0.1, 2.0), (0.2, 8.0), (0.4, 10.0), (0.6, 10.0), (0.8, 10.0), (INF, 10.0))


def test_a_percentile_is_interpolated_within_its_bucket_as_prometheus_does() -> None:
    # p90: the 9th of 10, half way from 8 to 10 in the bucket from 200 to 400 ms.
    assert histogram_quantile(0.9, TEN) == pytest.approx(0.3)
    # p50: the 5th, half way from 2 to 8 in the bucket from 100 to 200 ms.
    assert histogram_quantile(0.5, TEN) == pytest.approx(0.15)
    # In the lowest bucket, which is taken to start at 0: the 1st of its 2, from 0 to 100 ms.
    assert histogram_quantile(0.1, TEN) == pytest.approx(0.05)
    # In the +Inf bucket: the highest finite bound.
    assert histogram_quantile(0.9, ((0.1, 1.0), (1.0, 5.0), (INF, 10.0))) == 1.0
    assert histogram_quantile(0.9, ((0.1, 0.0), (INF, 0.0))) is None, "no observations"
    assert histogram_quantile(0.9, ((0.1, 3.0), (1.0, 5.0))) is None, "no +Inf bucket"


def _bucketed(values: list[float], bounds: tuple[float, ...]) -> Buckets:
    per_bucket = [0.0] * (len(bounds) + 1)
    for value in values:
        per_bucket[bisect.bisect_left(bounds, value)] += 1
    return tuple(zip((*bounds, INF), itertools.accumulate(per_bucket), strict=True))


def test_the_estimate_lies_in_the_bucket_of_the_true_percentile() -> None:
    bounds = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
    rng = random.Random(7)
    for _ in range(50):
        values = [rng.lognormvariate(-2.5, 1.2) for _ in range(rng.randint(20, 400))]
        for percentile in (50, 90, 99):
            exact = float(np.percentile(values, percentile, method="inverted_cdf"))
            estimate = histogram_quantile(percentile / 100, _bucketed(values, bounds))
            assert estimate is not None
            bucket = bisect.bisect_left(bounds, exact)
            if bucket == len(bounds):
                assert estimate == bounds[-1]
            else:
                assert (bounds[bucket - 1] if bucket else 0.0) <= estimate <= bounds[bucket]


def _tail_sample(time: float, queue_depth: float, mean: float, buckets: Buckets) -> MetricsSample:
    return MetricsSample(
        time=time, queue_depth=queue_depth, reporting_pods=2, ttft_seconds=mean, ttft_buckets=buckets
    )


# As RISING, but the means hide the tail: p90 300 ms at 2 requests per replica, 500 ms at 4 (bucket by
# bucket: 2/8/10 and 0/2/8/10 of ten), while the means are 150 and 200 ms.
TAILED = [
    _tail_sample(0, 4, 0.15, TEN),
    _tail_sample(10, 8, 0.2, ((0.1, 0.0), (0.2, 2.0), (0.4, 8.0), (0.6, 10.0), (0.8, 10.0), (INF, 10.0))),
]


def test_the_slo_policy_sizes_on_the_percentile_not_the_mean() -> None:
    at_p90 = LatencyTarget("time to first token", 0.6, 90)
    model = latency_model(TAILED, "time to first token", 90)
    assert model is not None
    assert (model.idle, model.per_unit) == (pytest.approx(0.1), pytest.approx(0.1))
    decision = decide(POLICY, TAILED, FleetState(2, 2), AutoscalerState(), 10, slo=[at_p90])
    # 20 requests forecast, 5 per replica within 600 ms at p90: 4 replicas.
    assert decision.replicas == 4
    assert decision.reason.startswith(
        "slo: time to first token p90 100ms + 100.0ms per request: 5.0 requests per replica within the 600ms"
    )
    # On the means (100 ms + 25 ms a request) a replica would take 20, trusted up to 8: 3 replicas.
    assert decide(POLICY, TAILED, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT]).replicas == 3


# Twenty first tokens a sample: at 2 requests per replica, 18 within 200 ms and 2 within 400; at 4, 18 within
# 400 ms and 2 within 600. p90 reads 200 and 400 ms, p92 240 and 440, p95 300 and 500.
SPREAD = [
    _tail_sample(0, 4, 0.2, ((0.1, 0.0), (0.2, 18.0), (0.4, 20.0), (0.6, 20.0), (INF, 20.0))),
    _tail_sample(10, 8, 0.4, ((0.1, 0.0), (0.2, 0.0), (0.4, 18.0), (0.6, 20.0), (INF, 20.0))),
]


def test_requests_that_waited_in_the_gateway_take_their_share_of_the_tail() -> None:
    at_p90 = LatencyTarget("time to first token", 0.7, 90)

    def waiting(share: float) -> ScaleDecision:
        samples = [dataclasses.replace(s, waits=Waits(100, 100 * share)) for s in SPREAD]
        return decide(POLICY, samples, FleetState(2, 2), AutoscalerState(), 10, slo=[at_p90])

    # None waited: the replicas' p90, 0 ms + 100 ms a request, 7 per replica within 700 ms; 20 forecast: 3.
    alone = waiting(0.0)
    assert alone.replicas == 3 and "7.0 requests per replica" in alone.reason and "waited" not in alone.reason
    # 2% waited: the replicas keep the other 8% of the tail, their p92: 40 ms + 100 ms a request, 6.6 per
    # replica: 4.
    some = waiting(0.02)
    assert some.replicas == 4 and "6.6 requests per replica" in some.reason
    assert some.reason.endswith("; 4 of 200 requests (2.0%) waited in the gateway, replicas held to p92")
    # 20% waited, more than the whole tail: the replicas keep half of it, their p95: 100 ms + 100 ms, 6.
    most = waiting(0.2)
    assert "6.0 requests per replica" in most.reason
    assert most.reason.endswith("; 40 of 200 requests (20.0%) waited in the gateway, replicas held to p95")
    # A mean has no tail to share, and a wait in the gateway comes before a first token, not between tokens.
    assert (
        "waited"
        not in decide(
            POLICY,
            [dataclasses.replace(s, waits=Waits(100, 20)) for s in SPREAD],
            FleetState(2, 2),
            AutoscalerState(),
            10,
            slo=[TTFT],
        ).reason
    )
    itl = [dataclasses.replace(s, itl_buckets=s.ttft_buckets, waits=Waits(100, 20)) for s in SPREAD]
    model = latency_model(itl, "inter-token latency", 90)
    assert model is not None and (model.idle, model.per_unit) == (pytest.approx(0.0), pytest.approx(0.1))


def test_a_replica_is_full_where_the_gateway_held_more_than_the_percentiles_tail() -> None:
    def holding(held: float, waited: float = 0.0, arrived: float = 50) -> list[MetricsSample]:
        # The replicas hold 4 requests each at 10 s, as in TAILED, and the gateway `held` more; `arrived`
        # requests reached it before each scrape, and `waited` of the latest ones waited there.
        earlier = dataclasses.replace(TAILED[0], waits=Waits(arrived, 0))
        latest = dataclasses.replace(TAILED[1], queue_depth=8 + held, held=held, waits=Waits(arrived, waited))
        return [earlier, latest]

    # Half a request of 8.5 held (6%): within the tenth a p90 target leaves to its tail, so the line
    # decides, (600 - 100) / 100 = 5 requests per replica within 600 ms.
    brief = latency_model(holding(0.5), "time to first token", 90)
    assert brief is not None and brief.full_at is None and brief.capacity(0.6) == pytest.approx(5.0)
    # 2 of 10 held (20%), and 20 of the window's 100 requests waited: more than the tail, so a replica is
    # full at the 4 it held, and sized at that.
    sustained = latency_model(holding(2, 20), "time to first token", 90)
    assert sustained is not None and sustained.full_at == 4 and sustained.capacity(0.6) == pytest.approx(4.0)
    # 2 of 10 held at the scrape, yet only 5 of the window's 100 requests waited: two requests that came
    # together, within the tail.
    chance = latency_model(holding(2, 5), "time to first token", 90)
    assert chance is not None and chance.full_at is None
    # 4 of 26 (15%), past the tail but within chance of it; 8 of 26 (31%), past it by more.
    few = latency_model(holding(2, 4, arrived=13), "time to first token", 90)
    assert few is not None and few.full_at is None
    more = latency_model(holding(2, 8, arrived=13), "time to first token", 90)
    assert more is not None and more.full_at == 4
    # A mean has no tail to spare: any held request marks the replicas full, where any waited.
    on_mean = latency_model(holding(0.5, 1), "time to first token")
    assert on_mean is not None and on_mean.full_at == 4
    none_waited = latency_model(holding(0.5), "time to first token")
    assert none_waited is not None and none_waited.full_at is None


def test_a_scrape_that_caught_requests_arriving_together_keeps_the_full_load_measured_before() -> None:
    at_p90 = LatencyTarget("time to first token", 1.0, 90)
    # One replica was full at 1440 prompt tokens/s. Now it serves 300 a second, its first tokens within
    # 50 ms, 13 requests over ten scrapes. One scrape catches a request held beside its two, after a second
    # in which it took 192 tokens; that request is sent on before the next scrape, beside another that
    # waited a moment: 2 of 13 waited (15%), as two arriving together do. (The mean of the scrapes' shares,
    # 1 and 1/2 over ten scrapes, was 15% too, and took the replica for full at 192.)
    fast = ((0.05, 10.0), (0.1, 10.0), (INF, 10.0))
    arrivals = [1, 2, 1, 1, 2, 0, 2, 1, 2, 1]
    quiet = [
        dataclasses.replace(
            _token_sample(t, 2, 300, 0.03), reporting_pods=1, ttft_buckets=fast, waits=Waits(arrived, 0)
        )
        for t, arrived in zip(range(50, 60), arrivals, strict=True)
    ]
    quiet[5] = dataclasses.replace(
        quiet[5], queue_depth=3, held=1, prompt_tokens_per_s=192, waits=Waits(0, 1)
    )
    quiet[6] = dataclasses.replace(quiet[6], waits=Waits(2, 1))
    state = AutoscalerState(full_throughput=(("time to first token", 1440.0),))
    decision = decide(POLICY, quiet, FleetState(1, 1), state, 59, slo=[at_p90])
    # Not full at 192: trusted with twice the 300 it served, below the 1440 it was full at, one replica for
    # the 298 tokens/s the window shows (sized at 192, two).
    assert decision.replicas == 1 and "600.0 prompt tokens/s per replica" in decision.reason, decision.reason
    assert "2 of 13 requests (15.4%) waited in the gateway" in decision.reason
    assert decision.state.full_throughput == (("time to first token", 1440.0),)


def test_the_fleets_histogram_adds_up_the_replicas_and_leaves_out_other_bounds() -> None:
    other_bounds = ((0.5, 1.0), (INF, 1.0))
    reports = [
        PodMetrics(waiting=0, running=2, ttft_buckets=TEN),
        PodMetrics(waiting=0, running=2, ttft_buckets=TAILED[1].ttft_buckets),
        PodMetrics(waiting=0, running=2, ttft_buckets=other_bounds),
        PodMetrics(waiting=0, running=2),
    ]
    sample = aggregate(0, reports, 4)
    assert sample is not None and sample.itl_buckets is None
    assert sample.ttft_buckets == (
        (0.1, 2.0), (0.2, 10.0), (0.4, 18.0), (0.6, 20.0), (0.8, 20.0), (INF, 20.0)
    )  # fmt: skip


@pytest.mark.parametrize("value", [49, 99.95, 100, "90", True])
def test_a_percentile_out_of_range_is_refused_with_a_clear_message(value: Any) -> None:
    spec = _spec({"ttftTargetMilliseconds": 500, "percentile": value})
    with pytest.raises(SpecError, match=r"spec\.sla\.percentile must be a number from 50 to 99\.9"):
        parse_spec(spec, name="chat")


def test_the_percentile_defaults_to_90_and_the_api_server_checks_its_range(crd_validator: Any) -> None:
    assert parse_spec(_spec({"ttftTargetMilliseconds": 500}), name="chat").sla.percentile == 90
    assert (
        parse_spec(_spec({"ttftTargetMilliseconds": 500, "percentile": 99.9}), name="chat").sla.percentile
        == 99.9
    )

    def errors(percentile: float) -> list[str]:
        spec = _spec({"ttftTargetMilliseconds": 500, "percentile": percentile})
        resource = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "chat"}, "spec": spec}
        return crd_validator.admit(resource)[1]

    assert errors(95) == []
    assert any("percentile" in error for error in errors(100))


def _token_sample(
    time: float,
    queue_depth: float,
    prompt_tokens_per_s: float,
    ttft: float,
    held: float = 0.0,
    waits: Waits = NO_WAITS,
) -> MetricsSample:
    return MetricsSample(
        time=time,
        queue_depth=queue_depth,
        reporting_pods=2,
        ttft_seconds=ttft,
        prompt_tokens_per_s=prompt_tokens_per_s,
        held=held,
        waits=waits,
    )


# Two replicas computing 1000 prompt tokens a second each answer in 200 ms; at 2000 each, in 300 ms.
TOKENS = [_token_sample(0, 4, 2000, 0.2), _token_sample(10, 8, 4000, 0.3)]


def test_with_token_counters_the_slo_policy_sizes_on_prompt_tokens_per_second() -> None:
    decision = decide(POLICY, TOKENS, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    # 100 ms + 100 ms per 1000 prompt tokens a second: 5000 within 600 ms, trusted up to twice the 2000
    # measured. The demand rose 200 tokens/s a second: 4000 + 30 × 200 = 10,000 forecast, 3 replicas.
    assert decision.replicas == 3
    assert decision.reason == (
        "slo: time to first token mean 100ms + 100.0ms per 1000 prompt tokens/s: 4000.0 prompt tokens/s per "
        "replica within the 600ms target; demand 4000.0 prompt tokens/s, 10000.0 forecast in 30s"
    )


def test_what_a_replica_served_while_the_gateway_held_requests_bounds_it_past_the_window() -> None:
    # At 10 s the replicas serve 2000 prompt tokens/s each with 4 requests apiece, and the gateway holds 6
    # more: the demand is 4000 × 14 / 8 = 7000 tokens/s, and a replica does 2000 at most.
    held = [_token_sample(0, 4, 2000, 0.2), _token_sample(10, 14, 4000, 0.3, held=6, waits=Waits(10, 4))]
    first = decide(POLICY, held, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    assert first.state.full_throughput == (("time to first token", 2000.0),)
    # 7000 + 30 × 500 = 22,000 forecast over 2000 a replica: 11, capped at 10.
    assert first.replicas == 6  # 2 + the step of 4
    assert "2000.0 prompt tokens/s per replica" in first.reason and "demand 7000.0" in first.reason
    # A minute on, the window holds no held request; the fleet serves 6000 tokens/s on 4 replicas. Without the
    # memory a replica would be trusted with twice the 1500 it serves; with it, 2000: 3 replicas, not 2 (the
    # scale-down delay keeps the 4 for now).
    later = [_token_sample(70, 8, 6000, 0.25, 0), _token_sample(72, 8, 6000, 0.25, 0)]
    later = [dataclasses.replace(s, reporting_pods=4) for s in later]
    remembered = decide(POLICY, later, FleetState(4, 4), first.state, 72, slo=[TTFT])
    assert "2000.0 prompt tokens/s per replica" in remembered.reason and remembered.replicas == 4
    forgotten = decide(POLICY, later, FleetState(4, 4), AutoscalerState(), 72, slo=[TTFT])
    assert "3000.0 prompt tokens/s per replica" in forgotten.reason


def test_a_fleet_full_and_refusing_is_sized_for_what_arrives_and_grows_while_the_gateway_still_holds() -> (
    None
):
    # Two replicas serve 2000 prompt tokens/s each with the gateway holding more than the tail beside them,
    # and it refuses a third of what arrives: 4000 / (1 - 1/3) = 6000 tokens/s arrive, three replicas'
    # worth at the load at which they are full.
    full = [_token_sample(time, 14, 4000, 0.3, held=6, waits=Waits(10, 4)) for time in (8, 10)]
    refusing = [dataclasses.replace(s, refused_share=1 / 3) for s in full]
    decision = decide(POLICY, refusing, FleetState(2, 2), AutoscalerState(), 10, slo=[TTFT])
    assert decision.replicas == 3
    assert "2000.0 prompt tokens/s per replica" in decision.reason
    demand = "demand 6000.0 prompt tokens/s with the 33% the gateway refused, 6000.0 forecast"
    assert demand in decision.reason
    # Three replicas at that load serve the 6000 with 4 requests each, and the gateway still holds 3 beside
    # them, refusing none: the held are demand too, 6000 × 15 / 12 = 7500, so the fleet grows out of it.
    sized = [
        dataclasses.replace(_token_sample(time, 15, 6000, 0.3, held=3, waits=Waits(10, 2)), reporting_pods=3)
        for time in (80, 82)
    ]
    grown = decide(POLICY, sized, FleetState(3, 3), decision.state, 82, slo=[TTFT])
    assert grown.replicas == 4 and "demand 7500.0 prompt tokens/s" in grown.reason


def test_the_most_a_replica_served_within_the_target_extends_the_lines_trust_past_the_window() -> None:
    # Two replicas at 2000 and 4000 prompt tokens/s each answer within the 600 ms target; at 6000, in 700 ms.
    busy = [
        _token_sample(0, 4, 4000, 0.2),
        _token_sample(10, 8, 8000, 0.3),
        _token_sample(20, 12, 12000, 0.7),
    ]
    first = decide(POLICY, busy, FleetState(2, 2), AutoscalerState(), 20, slo=[TTFT])
    assert first.state.proven_throughput == (("time to first token", 4000.0),)
    # A minute on, four replicas serve 1500 and then 1000 each: 100 ms + 50 ms per 1000 tokens/s, 10,000
    # within the target by the line; the demand is 5000 (falling). Trusted only as far as this window saw,
    # twice 1500: 3000 a replica, 2 replicas. With what was seen before, twice 4000: 8000, 1 replica.
    quiet = [_token_sample(70, 8, 6000, 0.175), _token_sample(72, 8, 4000, 0.15)]
    quiet = [dataclasses.replace(s, reporting_pods=4) for s in quiet]
    remembered = decide(POLICY, quiet, FleetState(4, 4), first.state, 72, slo=[TTFT])
    assert "8000.0 prompt tokens/s per replica" in remembered.reason, remembered.reason
    assert "demand 5000.0 prompt tokens/s, 5000.0 forecast" in remembered.reason
    forgotten = decide(POLICY, quiet, FleetState(4, 4), AutoscalerState(), 72, slo=[TTFT])
    assert "3000.0 prompt tokens/s per replica" in forgotten.reason, forgotten.reason
    assert remembered.state.proven_throughput == (("time to first token", 4000.0),)


def test_a_replica_is_full_at_the_median_load_of_the_samples_where_the_gateway_held_requests() -> None:
    # One request held in each, the replicas' load 3, 4 and 9 each: a scrape that caught a handful of
    # requests at once, or missed a replica, is not what a replica takes.
    full = [
        dataclasses.replace(_sample(t, queue_depth, ttft), held=1, waits=Waits(10, 1))
        for t, queue_depth, ttft in [(0, 7, 0.3), (1, 9, 0.4), (2, 19, 0.9)]
    ]
    model = latency_model(full, "time to first token")
    assert model is not None and model.full_at == 4
