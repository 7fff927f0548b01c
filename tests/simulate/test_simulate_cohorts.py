"""The cohort model: cohorts that hold what the requests hold, fluid engines against hand computation, the
gateway's queue of shares, the fleet against the request model on one trace, state that does not grow with
the trace, and `kvfleet simulate run --model cohort`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from kvfleet.cli import cli
from kvfleet.simulate.cohorts import Cohort, cohorts_of, generate_cohorts
from kvfleet.simulate.engine import EngineProfile
from kvfleet.simulate.fleet import Simulation, load_config
from kvfleet.simulate.fluid_engine import Arrivals, FluidEngines
from kvfleet.simulate.fluid_fleet import CohortOptions, CohortSimulation, _SpanMix
from kvfleet.simulate.held_cohorts import HeldCohorts, HeldShare
from kvfleet.simulate.report import RunReport
from kvfleet.simulate.trace import TraceRequest, TraceShapeSpec, generate, read_trace, write_trace

PROFILE = EngineProfile(step_fixed_s=0.005, prefill_token_s=0.00003, decode_sequence_s=0.000125)


def _service(**scaling: Any) -> dict[str, Any]:
    return {"model": {"uri": "hf://org/model"}, "scaling": scaling, "sla": {"ttftTargetMilliseconds": 300}}


def test_cohorts_of_a_trace_file_hold_its_requests_counts_and_tokens(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    write_trace(generate(TraceShapeSpec("multi-tenant", duration_s=30, base_rate=40, seed=2)), path)
    expected: Counter[tuple[int, str, str, str]] = Counter()
    for request in read_trace(path):
        key = (int(request.arrival_s // 0.5), request.tier, request.prefix_group)
        expected[(*key, "count")] += 1
        expected[(*key, "prompt")] += request.prompt_tokens
        expected[(*key, "output")] += request.output_tokens
    counted: Counter[tuple[int, str, str, str]] = Counter()
    for span in cohorts_of(read_trace(path), 0.5):
        assert len({cohort.start_s for cohort in span}) == 1
        for cohort in span:
            key = (round(cohort.start_s / 0.5), cohort.tier, cohort.prefix_group)
            counted[(*key, "count")] += cohort.count
            counted[(*key, "prompt")] += cohort.prompt_tokens
            counted[(*key, "output")] += cohort.output_tokens
    assert counted == expected and sum(v for k, v in counted.items() if k[3] == "count") > 1000


def test_generated_cohorts_hold_what_the_generators_requests_hold() -> None:
    spec = TraceShapeSpec("multi-tenant", duration_s=600, base_rate=50, seed=1)
    requests: Counter[str] = Counter()
    prompts: Counter[str] = Counter()
    for request in generate(spec):
        requests[request.tier] += 1
        prompts[request.tier] += request.prompt_tokens
    counts: Counter[str] = Counter()
    cohort_prompts: Counter[str] = Counter()
    for span in generate_cohorts(spec, 0.5):
        for cohort in span:
            counts[cohort.tier] += cohort.count
            cohort_prompts[cohort.tier] += cohort.prompt_tokens
    # About 10,000 requests a tier: Poisson's spread is 1%.
    assert set(counts) == set(requests) == {"critical", "standard", "batch"}
    for tier in requests:
        assert counts[tier] == pytest.approx(requests[tier], rel=0.04), tier
        assert cohort_prompts[tier] / counts[tier] == pytest.approx(prompts[tier] / requests[tier], rel=0.04)
    burst = TraceShapeSpec("burst", duration_s=100, base_rate=20, burst_start_s=40, burst_length_s=20)
    per_second = Counter(
        int(c.start_s) for span in generate_cohorts(burst, 0.5) for c in span for _ in range(c.count)
    )
    assert sum(per_second[s] for s in range(40, 60)) / 20 == pytest.approx(200, rel=0.1)
    assert sum(per_second[s] for s in range(0, 40)) / 40 == pytest.approx(20, rel=0.15)


def _engines(profile: EngineProfile = PROFILE) -> tuple[FluidEngines, Arrivals, int]:
    engines = FluidEngines(profile, capacity=1)
    slot = engines.add()
    return engines, Arrivals(engines.capacity), slot


def test_a_request_at_an_idle_engine_has_its_first_token_after_one_step_with_its_prompt() -> None:
    engines, arrivals, slot = _engines()
    arrivals.requests[slot], arrivals.work[slot], arrivals.prompt[slot], arrivals.output[slot] = (
        1,
        400,
        400,
        50,
    )
    latencies = engines.advance(0.1, arrivals)
    assert latencies.at_once[slot] == 1 and latencies.waiting[slot] == 0
    assert latencies.at_once_s[slot] == pytest.approx(PROFILE.step_seconds(400, 0, 0))


def test_the_engines_run_where_numba_has_nowhere_to_cache_their_compiled_code() -> None:
    # As with a read-only install and home: numba is told to look for a cache folder in zip files only.
    script = """
from kvfleet.simulate.engine import EngineProfile
from kvfleet.simulate.fluid_engine import Arrivals, FluidEngines
engines = FluidEngines(EngineProfile(step_fixed_s=0.005, prefill_token_s=0.00003), capacity=1)
slot = engines.add()
arrivals = Arrivals(engines.capacity)
arrivals.requests[slot], arrivals.work[slot], arrivals.prompt[slot], arrivals.output[slot] = 1, 400, 400, 50
print(engines.advance(0.1, arrivals).at_once_s[slot])
"""
    environment = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "ZipCacheLocator"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == pytest.approx(0.005 + 0.00003 * 400)


def test_places_in_the_batch_bound_what_runs_and_the_rest_waits_longer() -> None:
    profile = EngineProfile(
        step_fixed_s=0.005, prefill_token_s=0.00003, decode_sequence_s=0.000125, max_num_seqs=4
    )
    engines, arrivals, slot = _engines(profile)
    arrivals.requests[slot], arrivals.work[slot], arrivals.prompt[slot], arrivals.output[slot] = (
        10,
        1000,
        1000,
        500,
    )
    latencies = engines.advance(0.05, arrivals)
    assert latencies.at_once[slot] == 4 and latencies.waiting[slot] == 6
    # The four's prompts (400 tokens) fit one step's budget: their mean is one such step.
    assert latencies.at_once_s[slot] == pytest.approx(profile.step_seconds(400, 0, 0))
    # The six wait for places that free only as 50-token outputs finish: far longer.
    assert latencies.waiting_s[slot] > 10 * latencies.at_once_s[slot]
    (report,) = engines.report([slot], 0.05)
    assert report.running == 4 and report.waiting == 6


def test_a_full_batch_decodes_at_the_profiles_step_time() -> None:
    # More than a batch's worth arriving each tick (100-token outputs): the batch stays full of 32 decoding
    # requests, so tokens come at 32 a decode step of 5 ms + 32 x 0.125 ms (one-token prompts add little).
    engines, arrivals, slot = _engines()
    ticks, tick_s = 600, 0.1
    for _ in range(ticks):
        arrivals.requests[slot], arrivals.work[slot], arrivals.prompt[slot], arrivals.output[slot] = (
            5,
            5,
            5,
            500,
        )
        engines.advance(tick_s, arrivals)
        arrivals.requests[slot] = arrivals.work[slot] = arrivals.prompt[slot] = arrivals.output[slot] = 0.0
    (report,) = engines.report([slot], ticks * tick_s)
    assert report.generation_tokens_per_s == pytest.approx(32 / PROFILE.step_seconds(0, 32, 0), rel=0.03)
    assert report.running == pytest.approx(32) and report.waiting > 100


def test_a_full_gateway_queue_sheds_by_the_gateways_precedence() -> None:
    report = RunReport(0.3, 60)
    for tier in ("critical", "batch"):
        report.arrived(tier, 10)
    held = HeldCohorts(max_queue=10, report=report)
    held.hold(HeldShare("batch", "", 8, 800, 80, 0.0))
    held.hold(HeldShare("batch", "", 4, 400, 40, 1.0))
    # Two batch requests found no place: the newcomers are refused (equal tiers never displace).
    assert held.held == 10 and report.tiers["batch"].shed == 2 and report.tiers["batch"].waited == 10
    held.hold(HeldShare("critical", "", 6, 600, 60, 2.0))
    # Six critical ones take the places of the newest batch requests: first the 2 left of the share at 1 s,
    # then 4 of the one at 0 s.
    assert held.held == 10 and report.tiers["batch"].shed == 8 and report.tiers["critical"].shed == 0
    # What the operator reads of the gateway: 20 arrived, 8 refused, 16 waited in the queue.
    assert report.gateway_counts() == (20, 8, 16)
    head = held.head()
    assert head is not None and head.tier == "critical"
    sent = held.take(head, 2.5)
    assert sent.count == 2.5 and sent.prompt_tokens == 250 and held.held == 7.5
    held.expire(now=100.0, hold_s=60.0)
    assert held.held == 0 and report.tiers["critical"].shed == 3.5


def test_the_cohort_model_stays_near_the_request_model_on_one_trace() -> None:
    # A burst that the autoscaler must follow: both models run on the same trace, with the gateway's and the
    # operator's code deciding in each.
    service = _service(minReplicas=1, maxReplicas=40, policy="slo")
    spec = TraceShapeSpec(
        "burst", duration_s=480, base_rate=15, peak_ratio=4, burst_start_s=160, burst_length_s=160
    )
    runs = {}
    for model in ("request", "cohort"):
        config = load_config(service, PROFILE, pod_start_s=11, initial_replicas=2)
        if model == "request":
            runs[model] = Simulation(config).run(generate(spec))
        else:
            runs[model] = CohortSimulation(config).run(generate_cohorts(spec, 0.5))
    request, cohort = runs["request"], runs["cohort"]
    assert cohort["model"] == "cohort"
    assert cohort["requests"] == pytest.approx(request["requests"], rel=0.03)
    assert cohort["attainment"] == pytest.approx(request["attainment"], abs=0.03)
    assert cohort["replica_hours"] == pytest.approx(request["replica_hours"], rel=0.25)
    assert cohort["scale_events"] > 0


def test_a_fleet_of_more_replicas_than_pieces_a_span_is_served_as_in_the_request_model() -> None:
    # A hundred replicas near their knee and a span's arrivals cut into 16 pieces: a replica takes a piece
    # every six spans or so, streamed to it at the pace of its share of the arrivals (a second piece before
    # the first is through lengthens its stream, as arrivals do not come faster for it). The gateway passes
    # a replica at its cap by at once, as it does a request: what waits in its queue is what finds every
    # replica full, none here.
    service = _service(minReplicas=100, maxReplicas=100)
    spec = TraceShapeSpec("multi-tenant", duration_s=60, base_rate=1550)
    config = load_config(service, PROFILE, initial_replicas=100)
    request = Simulation(config).run(generate(spec))
    cohort = CohortSimulation(config, CohortOptions(pieces_per_span=16)).run(generate_cohorts(spec, 0.5))
    assert request["waited"] == 0 and cohort["waited"] < 1e-3 * cohort["requests"]
    assert cohort["attainment"] == pytest.approx(request["attainment"], abs=0.005)
    # A fluid has no request-to-request spread: its p90 is under the request model's, its median over.
    assert cohort["ttft_p90_s"] == pytest.approx(request["ttft_p90_s"], rel=0.4)


def test_a_mixed_piece_takes_its_part_of_every_cohort_and_computes_a_prefix_once_a_replica() -> None:
    cohorts = [
        Cohort(0.0, 0.5, "critical", "critical-0", 4, 1024, 100),
        Cohort(0.0, 0.5, "batch", "batch-0", 2, 3000, 400),
        Cohort(0.0, 0.5, "batch", "", 1, 500, 50),
    ]
    mix = _SpanMix(cohorts, shared_prefix_tokens=256)
    cached = {"critical-0"}
    # critical-0's requests find 255 tokens each cached (their mean prompt less one), batch-0's all 256;
    # the replica has not yet computed batch-0's prefix, so the piece's first request of it does.
    first = {
        share.tier: (share.count, share.prompt_tokens, share.output_tokens, work)
        for share, work in mix.piece(0.5, cached, now=1.0)
    }
    assert first == {"critical": (2, 512, 50, 2), "batch": (1.5, 1750, 225, 1494 + 256)}
    assert cached == {"critical-0", "batch-0"}
    second = {share.tier: work for share, work in mix.piece(0.5, cached, now=1.0)}
    assert second == {"critical": 2, "batch": 1494}


def test_the_cohort_models_state_does_not_grow_with_the_trace() -> None:
    service = _service(replicas=4)
    sizes = []
    for duration in (30, 240):
        spec = TraceShapeSpec("steady", duration_s=duration, base_rate=40)
        simulation = CohortSimulation(load_config(service, PROFILE))
        summary = simulation.run(generate_cohorts(spec, 0.5))
        assert summary["requests"] > 35 * duration
        sizes.append(summary["peak_state_size"])
    assert sizes[0] == sizes[1]


def test_run_with_the_cohort_model_writes_its_report(tmp_path: Path) -> None:
    runner = CliRunner()
    trace, spec_path = tmp_path / "trace.csv", tmp_path / "trace.yaml"
    write_trace(generate(TraceShapeSpec("multi-tenant", duration_s=60, base_rate=20)), trace)
    spec_path.write_text(yaml.safe_dump({"shape": "multi-tenant", "duration_s": 60, "base_rate": 20}))
    (tmp_path / "slo.yaml").write_text(yaml.safe_dump(_service(policy="slo")))
    service = ["--service", str(tmp_path / "slo.yaml")]
    for source in (["--trace", str(trace)], ["--trace-spec", str(spec_path)]):
        out = tmp_path / "report.json"
        ran = runner.invoke(
            cli, ["simulate", "run", "--model", "cohort", *service, *source, "--out", str(out)]
        )
        assert ran.exit_code == 0, ran.output
        summary = json.loads(out.read_text())["slo"]
        assert summary["model"] == "cohort" and summary["requests"] == pytest.approx(1200, rel=0.1)
        assert set(summary["tiers"]) == {"critical", "standard", "batch"} and summary["series"]
    both = runner.invoke(
        cli,
        ["simulate", "run", *service, "--trace", str(trace), "--trace-spec", str(spec_path), "--out", "x"],
    )
    assert both.exit_code == 2 and "one of --trace and --trace-spec" in both.output
    uneven = runner.invoke(
        cli,
        [
            "simulate",
            "run",
            "--model",
            "cohort",
            "--tick-ms",
            "300",
            *service,
            "--trace",
            str(trace),
            "--out",
            "x",
        ],
    )
    assert uneven.exit_code == 2 and "whole number of ticks" in uneven.output


@pytest.mark.parametrize("model", ["request", "cohort"])
def test_a_first_token_reaches_its_client_the_calibrated_overhead_after_the_engine_made_it(
    model: str,
) -> None:
    # A light steady load on one replica: the overhead (the request's way in and the token's way out, which
    # calibration through a gateway measures) moves every client's first token and no engine step.
    spec = TraceShapeSpec("steady", duration_s=60, base_rate=4)
    medians = {}
    for overhead in (0.0, 0.05):
        config = load_config(
            _service(minReplicas=1, maxReplicas=1), replace(PROFILE, first_token_overhead_s=overhead)
        )
        if model == "request":
            medians[overhead] = Simulation(config).run(generate(spec))["ttft_p50_s"]
        else:
            medians[overhead] = CohortSimulation(config).run(generate_cohorts(spec, 0.5))["ttft_p50_s"]
    # Percentiles are read from buckets 1% apart.
    assert medians[0.05] - medians[0.0] == pytest.approx(0.05, rel=0.05)


def test_a_first_token_beside_a_decoding_batch_waits_the_overhead_of_each_sequence_beside_it() -> None:
    # Four requests decode on a replica of five places all along (100,000 tokens each) while short ones
    # arrive alone, one a second: each short one is taken in beside four sequences, so its overhead grows by
    # four sequences' (nothing else changes: the engine is the same, and the short ones never meet).
    trace = [TraceRequest(0.0, 16, 100_000) for _ in range(4)]
    trace += [TraceRequest(1.0 + n, 16, 1) for n in range(20)]
    service = {**_service(minReplicas=1, maxReplicas=1), "engine": {"maxNumSeqs": 5}}
    medians = {}
    for per_sequence in (0.0, 0.1):
        config = load_config(service, replace(PROFILE, first_token_overhead_per_sequence_s=per_sequence))
        medians[per_sequence] = Simulation(config).run(iter(trace))["ttft_p50_s"]
    # Percentiles are read from buckets 1% apart.
    assert medians[0.1] - medians[0.0] == pytest.approx(0.4, rel=0.03), medians


def test_the_cohort_model_counts_the_overhead_of_the_sequences_beside_a_first_token() -> None:
    # A request every 1/7 s, each 100 tokens, on a replica of four places: a batch of four runs at about 7.3
    # a second, so the batch is nearly full, and a first token has close to three sequences beside it (a
    # fluid's batch is a little under full at times, but never over: the waiting are not in the step).
    trace = [TraceRequest(n / 7, 16, 100) for n in range(420)]
    service = {**_service(minReplicas=1, maxReplicas=1), "engine": {"maxNumSeqs": 4}}
    medians = {}
    for per_sequence in (0.0, 0.1):
        config = load_config(service, replace(PROFILE, first_token_overhead_per_sequence_s=per_sequence))
        medians[per_sequence] = CohortSimulation(config).run(cohorts_of(iter(trace), 0.5))["ttft_p50_s"]
    beside = (medians[0.1] - medians[0.0]) / 0.1
    # At most three, give or take the percentile's bucket (1% wide).
    assert 2.5 <= beside <= 3.03, medians
