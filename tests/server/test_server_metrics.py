"""Metric names (kvfleet's and vLLM's) and what one request's outputs record."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest
from kvfleet.runtime.bench.startup import phases_from_metrics
from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet.runtime.metrics import ServerMetrics

if TYPE_CHECKING:
    from servers import ServerProcess


def _output(tokens: int, *, first: float, last: float, finished: str | None = None) -> RequestOutput:
    times = RequestMetrics(
        arrival_time=0.0, first_scheduled_time=0.1, first_token_time=first, last_token_time=last
    )
    if finished:
        times.finished_time = last
    completion = CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None, finished)
    return RequestOutput("r", None, [1, 2, 3], [completion], finished is not None, metrics=times)


def _sample(text: str, line_start: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_metrics_names_and_observations() -> None:
    metrics = ServerMetrics("m")
    metrics.set_stats_source(lambda: SchedulerStats(3, 7, 2, 0.25, 100, 40, 500))
    tracker = metrics.track("critical", num_prompt_tokens=3)
    tracker.observe(_output(1, first=0.5, last=0.5))
    tracker.observe(_output(1, first=0.5, last=0.6))
    tracker.observe(_output(1, first=0.5, last=0.8, finished="length"))
    metrics.track("batch", 10).aborted()
    metrics.record_rejected("shed", "batch")
    text = metrics.render().decode()

    for prefix in ("kvfleet", "vllm"):
        assert _sample(text, f'{prefix}:num_requests_running{{model_name="m"}}') == 3
        assert _sample(text, f'{prefix}:num_requests_waiting{{model_name="m"}}') == 7
        assert _sample(text, f'{prefix}:kv_cache_usage_perc{{model_name="m"}}') == 0.25
        assert _sample(text, f'{prefix}:num_preemptions_total{{model_name="m"}}') == 2
        assert _sample(text, f'{prefix}:prefix_cache_hits_total{{model_name="m"}}') == 40
    assert _sample(text, 'vllm:gpu_cache_usage_perc{model_name="m"}') == 0.25
    assert _sample(text, 'vllm:prompt_tokens_total{model_name="m"}') == 3
    assert _sample(text, 'kvfleet:generation_tokens_total{model_name="m",tier="critical"}') == 3
    assert _sample(text, 'vllm:time_to_first_token_seconds_sum{model_name="m"}') == pytest.approx(0.5)
    assert _sample(text, 'kvfleet:time_to_first_token_seconds_count{model_name="m",tier="critical"}') == 1
    assert _sample(text, 'vllm:inter_token_latency_seconds_count{model_name="m"}') == 2
    assert _sample(text, 'vllm:inter_token_latency_seconds_sum{model_name="m"}') == pytest.approx(0.3)
    assert _sample(text, 'vllm:time_per_output_token_seconds_count{model_name="m"}') == 2
    assert _sample(text, 'vllm:e2e_request_latency_seconds_sum{model_name="m"}') == pytest.approx(0.8)
    assert _sample(text, 'vllm:request_queue_time_seconds_sum{model_name="m"}') == pytest.approx(0.1)
    assert _sample(text, 'vllm:request_success_total{finished_reason="length",model_name="m"}') == 1
    assert _sample(text, 'vllm:request_success_total{finished_reason="abort",model_name="m"}') == 1
    assert _sample(text, 'kvfleet:requests_rejected_total{model_name="m",reason="shed",tier="batch"}') == 1


def test_each_tier_records_into_its_own_series() -> None:
    """A tier's series are looked up once and kept: the tiers that follow record into theirs, not its."""
    metrics = ServerMetrics("m")
    for tier, tokens in (("critical", 3), ("batch", 2), ("critical", 1)):
        metrics.track(tier, num_prompt_tokens=4).observe(_output(tokens, first=0.5, last=0.5))
    text = metrics.render().decode()

    assert _sample(text, 'kvfleet:generation_tokens_total{model_name="m",tier="critical"}') == 4
    assert _sample(text, 'kvfleet:generation_tokens_total{model_name="m",tier="batch"}') == 2
    assert _sample(text, 'vllm:generation_tokens_total{model_name="m"}') == 6
    assert _sample(text, 'kvfleet:time_to_first_token_seconds_count{model_name="m",tier="critical"}') == 2
    assert _sample(text, 'kvfleet:time_to_first_token_seconds_count{model_name="m",tier="batch"}') == 1
    assert _sample(text, 'vllm:time_to_first_token_seconds_count{model_name="m"}') == 3


def test_engine_info_names_the_chosen_attention_backend(api_server: ServerProcess) -> None:
    text = httpx.get(f"{api_server.url}/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("kvfleet:engine_info{"))
    # On a machine without a GPU the selector must settle on the torch backend.
    assert 'attention_backend="sdpa"' in line
    assert 'device="cpu"' in line
    assert line.endswith(" 1.0")


def test_the_start_phases_of_both_processes_reach_metrics(api_server: ServerProcess) -> None:
    text = httpx.get(f"{api_server.url}/metrics", timeout=10).text
    phases = phases_from_metrics(text)
    core = ("engine_core_imports", "attention_backend", "weights", "kv_cache", "engine_core_setup")
    api = (
        "interpreter",
        "config",
        "api_server_settings",
        "api_server_imports",
        "api_server_app",
        "api_server_bind",
        "tokenizer",
    )
    assert set(phases) >= {*core, *api}
    assert all(seconds >= 0 for seconds in phases.values())
    ready = _sample(text, f'kvfleet:startup_seconds{{model_name="{api_server.model_name}"}}')
    # Both ran before the engine was ready: the API server's first phases one after the other in its own
    # process, and the core's, in the process it started after them.
    assert ready >= phases["interpreter"] + phases["config"]
    assert ready >= sum(phases[name] for name in core)
