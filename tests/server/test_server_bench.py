"""`kvfleet bench serve`: the seeded workload, the statistics, and a real run against a real server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
import httpx
import pytest
from kvfleet.runtime.bench.serve import OVERLOAD_MIX, BenchSettings, parse_tier_mix
from kvfleet.runtime.bench.serve_client import build_workload
from kvfleet.runtime.bench.serve_report import RequestResult, percentile, summarize

if TYPE_CHECKING:
    from servers import ServerProcess


def test_workload_is_seeded_and_follows_the_settings() -> None:
    settings = BenchSettings(
        url="-", num_prompts=400, request_rate=20.0, input_len=40, output_len=10, range_ratio=0.5, seed=3
    )
    settings.tier_mix = parse_tier_mix("critical=1,batch=3")
    workload = build_workload(settings, vocab_size=100)
    assert workload == build_workload(settings, vocab_size=100)
    assert workload != build_workload(BenchSettings(**{**settings.__dict__, "seed": 4}), vocab_size=100)
    assert all(20 <= len(r.prompt_token_ids) <= 60 and 5 <= r.output_len <= 15 for r in workload)
    assert all(16 <= t < 100 for r in workload for t in r.prompt_token_ids)
    # Poisson arrivals at 20/s: 400 requests span about 20 s.
    assert 16 < workload[-1].send_at < 24
    assert sorted(r.send_at for r in workload) == [r.send_at for r in workload]
    critical_share = sum(r.tier == "critical" for r in workload) / len(workload)
    assert 0.18 < critical_share < 0.32
    # The workload of `make bench-vs-vllm`: prompts 16-256 tokens, outputs 16-128, each range reached.
    wide = BenchSettings(url="-", num_prompts=2000, input_len=136, output_len=72, range_ratio=0.8824)
    wide.output_range_ratio = 0.7778
    prompt_lens = [len(r.prompt_token_ids) for r in build_workload(wide, vocab_size=100)]
    output_lens = [r.output_len for r in build_workload(wide, vocab_size=100)]
    assert (min(prompt_lens), max(prompt_lens), min(output_lens), max(output_lens)) == (16, 256, 16, 128)
    burst = build_workload(BenchSettings(url="-", num_prompts=5), vocab_size=100)
    assert {r.send_at for r in burst} == {0.0} and {r.tier for r in burst} == {None}


def test_tier_mix_parsing() -> None:
    assert parse_tier_mix("overload") == parse_tier_mix(OVERLOAD_MIX)
    assert parse_tier_mix("a=1,b=3") == {"a": 0.25, "b": 0.75}
    assert parse_tier_mix(None) == {}
    for bad in ("a", "a=x", "a=0", "a=-1,b=2"):
        with pytest.raises(click.BadParameter):
            parse_tier_mix(bad)


def test_summary_statistics() -> None:
    results = [
        RequestResult("batch", 10, output_tokens=5, ttft=0.1, itl=[0.01] * 4, latency=0.14),
        RequestResult("batch", 10, output_tokens=5, ttft=0.3, itl=[0.03] * 4, latency=0.42),
        RequestResult("critical", 20, error="shed"),
    ]
    summary = summarize(results, duration=2.0)
    assert summary["completed"] == 2 and summary["failed"] == {"shed": 1}
    assert summary["output_tokens"] == 10 and summary["input_tokens"] == 20
    assert summary["output_throughput"] == 5.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200)
    assert summary["tpot_ms"]["mean"] == pytest.approx((10 + 30) / 2)
    assert summary["per_tier"]["critical"] == {
        "completed": 0,
        "failed": 1,
        "ttft_ms": {"mean": None, "p50": None, "p90": None, "p99": None},
        "tpot_ms": {"mean": None, "p50": None, "p90": None, "p99": None},
        "itl_ms": {"mean": None, "p50": None, "p90": None, "p99": None},
        "e2e_ms": {"mean": None, "p50": None, "p90": None, "p99": None},
    }
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0


def test_bench_serve_against_a_server(api_server: ServerProcess, tmp_path: Path) -> None:
    result_json = tmp_path / "result.json"
    args = [sys.executable, "-P", "-m", "kvfleet", "bench", "serve", "--url", api_server.url]
    args += [
        "--api-key",
        api_server.api_key,
        "--num-prompts",
        "12",
        "--request-rate",
        "30",
        "--input-len",
        "16",
    ]
    args += ["--output-len", "6", "--tier-mix", "overload", "--seed", "1", "--result-json", str(result_json)]
    completed = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "Serving Benchmark Result" in completed.stdout and "Per SLA tier" in completed.stdout
    result = json.loads(result_json.read_text())
    settings = BenchSettings(url="-", num_prompts=12, request_rate=30, input_len=16, output_len=6, seed=1)
    settings.tier_mix = parse_tier_mix("overload")
    workload = build_workload(settings, vocab_size=1024)
    assert result["completed"] == 12 and result["failed"] == {}
    assert result["output_tokens"] == sum(r.output_len for r in workload)
    assert result["input_tokens"] == sum(len(r.prompt_token_ids) for r in workload)
    assert result["ttft_ms"]["p50"] > 0 and math.isfinite(result["ttft_ms"]["p99"])
    expected_tiers = {r.tier for r in workload}
    assert set(result["per_tier"]) == expected_tiers
    assert sum(tier["completed"] for tier in result["per_tier"].values()) == 12


def test_static_server_serves_with_the_static_batching_core(
    start_server: Callable[..., ServerProcess],
) -> None:
    # When static batching admits what is proven on the core (tests/runtime/engine/test_engine_core.py).
    server = start_server("--max-num-seqs", "2", command=("bench", "static-server"))
    assert "StaticBatchingEngineCore ready" in server.log_tail(80)
    replies = []

    def complete() -> None:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True}
        replies.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=complete) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [reply.json()["usage"]["completion_tokens"] for reply in replies] == [20, 20, 20]
