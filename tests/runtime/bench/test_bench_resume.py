"""The pure parts of `kvfleet bench resume`: reading the gateway's resume metrics as prometheus_client exposes
them, quantiles of a histogram, which streams a stop hit, and the report."""

from __future__ import annotations

import random
import statistics

import pytest
from click.testing import CliRunner
from kvfleet.runtime.bench.cli import bench
from kvfleet.runtime.bench.resume import (
    RESUME_SECONDS,
    ResumeSettings,
    StreamTrace,
    format_resume_report,
    gateway_resume_figures,
    histogram_quantile,
    resume_prompts,
    summarize_round,
    waits_after_stop,
)
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5)


def _exposed_gateway_metrics(latencies: list[float], causes: dict[str, int], replayed: int) -> str:
    """A /metrics page with the gateway's resume metrics, as prometheus_client writes it, for two models."""
    registry = CollectorRegistry()
    resumes = Counter("kvfleet_gateway_resumes", "", ["model", "cause"], registry=registry)
    tokens = Counter("kvfleet_gateway_resumed_tokens", "", ["model"], registry=registry)
    seconds = Histogram(RESUME_SECONDS, "", ["model"], buckets=BUCKETS, registry=registry)
    for number, latency in enumerate(latencies):
        seconds.labels(model=f"m{number % 2}").observe(latency)
    for cause, count in causes.items():
        resumes.labels(model="m0", cause=cause).inc(count)
    tokens.labels(model="m0").inc(replayed - 1)
    tokens.labels(model="m1").inc(1)
    return generate_latest(registry).decode()


def test_gateway_figures_sum_over_models_and_their_quantiles_match_the_observations() -> None:
    rng = random.Random(0)
    # Uniform over the finite buckets: linear interpolation within a bucket is then what the data does.
    latencies = [rng.uniform(0, BUCKETS[-1]) for _ in range(20_000)]
    figures = gateway_resume_figures(_exposed_gateway_metrics(latencies, {"reset": 3, "drain": 2}, 70))
    assert figures["resumes"] == {"reset": 3.0, "drain": 2.0}
    assert figures["replayed_tokens"] == 70.0
    assert figures["buckets"][-1] == (float("inf"), len(latencies))
    for q in (0.5, 0.9, 0.99):
        expected = statistics.quantiles(latencies, n=100)[round(q * 100) - 1]
        assert histogram_quantile(q, figures["buckets"]) == pytest.approx(expected, abs=0.03)


def test_a_quantile_past_the_last_bound_is_that_bound_and_an_empty_histogram_has_none() -> None:
    figures = gateway_resume_figures(_exposed_gateway_metrics([0.05, 9.0, 9.0, 9.0], {}, 1))
    assert histogram_quantile(0.99, figures["buckets"]) == BUCKETS[-1]
    assert (
        histogram_quantile(0.5, gateway_resume_figures(_exposed_gateway_metrics([], {}, 1))["buckets"])
        is None
    )


def _trace(arrivals: list[float]) -> StreamTrace:
    return StreamTrace(arrivals=arrivals, token_ids=list(range(len(arrivals))), finish_reason="length")


def test_the_streams_a_stop_hit_are_those_that_waited_longest_for_their_next_token() -> None:
    stopped_at = 10.0
    rng = random.Random(1)
    hit = {number: rng.uniform(0.3, 2.0) for number in range(0, 12, 3)}
    traces = []
    for number in range(12):
        before = [stopped_at - 0.05 * step for step in range(5, 0, -1)]
        # A stream the stop did not hit gets its next token within a step; a hit one after its resume.
        first_after = stopped_at + hit.get(number, rng.uniform(0.001, 0.05))
        traces.append(_trace(before + [first_after + 0.05 * step for step in range(5)]))
    traces.append(_trace([stopped_at + 5.0]))  # started after the stop: not a resumed stream
    traces.append(_trace([stopped_at - 1.0]))  # ended before it
    assert waits_after_stop(traces, stopped_at, len(hit)) == pytest.approx(sorted(hit.values()))
    assert waits_after_stop(traces, stopped_at, 0) == []
    assert len(waits_after_stop(traces, stopped_at, 100)) == 12


def test_a_round_is_summarized_and_reported_from_its_traces_and_metrics() -> None:
    stopped_at = 1.0
    traces = [_trace([0.5, 0.9, 1.4, 1.5]), _trace([0.6, 0.95, 1.02, 1.1]), StreamTrace(error="ReadError")]
    gateway = gateway_resume_figures(_exposed_gateway_metrics([0.3, 0.45], {"reset": 1}, 2))
    run = summarize_round(traces, stopped_at, gateway, {"resumed_tokens": 258.0, "resumed_requests": 1.0})
    assert run["complete"] == 2 and run["errors"] == ["ReadError"] and run["token_counts"] == [0, 4]
    assert run["client_resume_ms"]["p50"] == pytest.approx(400.0)
    assert 250.0 <= run["gateway_resume_ms"]["p50"] <= 500.0
    assert run["generated_tokens"] == 8 and run["gateway_replayed_tokens"] == 2.0
    report = {"load_average": (1.0, 1.0, 1.0), "load_average_after": (2.0, 2.0, 2.0), "rounds": [run]}
    text = format_resume_report(report)
    assert "| 1 | 2/3 | reset 1 |" in text and "| 8 | 2 | 258 |" in text
    assert "round 1: errors ['ReadError'], token counts [0, 4]" in text


def test_rounds_draw_prompts_of_their_own_from_the_seed() -> None:
    settings = ResumeSettings(streams=3, prompt_len=5, seed=7)
    first = resume_prompts(settings, 100, 0)
    assert first == resume_prompts(settings, 100, 0)
    assert first != resume_prompts(settings, 100, 1)
    assert all(len(prompt) == 5 and all(16 <= token < 100 for token in prompt) for prompt in first)


def test_the_command_is_wired() -> None:
    result = CliRunner().invoke(bench, ["resume", "--help"])
    assert result.exit_code == 0 and "--stop [kill|term]" in result.output
