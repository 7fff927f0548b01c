"""`kvfleet bench serve` against a real server with vLLM's flags, read back from its result files."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from kvfleet.runtime.bench.serve import BenchSettings, parse_tier_mix
from kvfleet.runtime.bench.serve_client import build_workload
from transformers import AutoTokenizer
from vllm_bench_keys import DETAILED_KEYS, RESULT_KEYS, SETUP_KEYS, metric_keys

if TYPE_CHECKING:
    from servers import ServerProcess


STREAM_INTERVAL = 3


def test_bench_serve_against_a_server(api_server: ServerProcess, tmp_path: Path) -> None:
    """vLLM's flags, its result file's keys, goodput and tiers on a real run; and never the API key."""
    args = [sys.executable, "-P", "-m", "kvfleet", "bench", "serve", "--base-url", api_server.url]
    args += ["--api-key", api_server.api_key, "--header", "x-bench=1", "--num-prompts", "12"]
    args += [
        "--request-rate",
        "30",
        "--burstiness",
        "0.5",
        "--random-input-len",
        "16",
        "--random-output-len",
        "6",
    ]
    args += ["--tier-mix", "overload", "--seed", "1", "--goodput", "ttft:60000", "e2el:60000"]
    args += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9"]
    args += [
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "run.json",
    ]
    args += ["--metadata", "engine=kvfleet", "build=ci", "--label", "tiers"]
    args += ["--extra-body", json.dumps({"stream_interval": STREAM_INTERVAL})]
    completed = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "Serving Benchmark Result" in completed.stdout and "Per SLA tier" in completed.stdout
    assert "12/12" in completed.stderr  # the progress bar
    text = (tmp_path / "run.json").read_text()
    assert api_server.api_key not in text and "Bearer" not in text and "x-bench" not in text
    result = json.loads(text)
    metrics = metric_keys(["ttft", "tpot", "itl", "e2el"], ["50", "90", "99.9"])
    assert set(result) == SETUP_KEYS | RESULT_KEYS | metrics | {"engine", "build", "per_tier"}
    assert (result["engine"], result["build"], result["label"], result["backend"]) == (
        "kvfleet",
        "ci",
        "tiers",
        "openai",
    )
    assert (result["request_rate"], result["burstiness"], result["max_concurrency"]) == (30.0, 0.5, None)
    settings = BenchSettings(
        base_url="-",
        num_prompts=12,
        request_rate=30,
        burstiness=0.5,
        random_input_len=16,
        random_output_len=6,
        seed=1,
        tier_mix=parse_tier_mix("overload"),
    )
    workload = build_workload(settings, vocab_size=1024)
    assert result["completed"] == 12 and result["failed"] == 0 and result["errors"] == [""] * 12
    assert result["output_lens"] == [r.output_len for r in workload]
    assert result["input_lens"] == [len(r.prompt_token_ids) for r in workload]
    assert result["total_output_tokens"] == sum(r.output_len for r in workload)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 0 < result["median_ttft_ms"] <= result["p99.9_ttft_ms"] and math.isfinite(result["p99.9_ttft_ms"])
    # The extra body's stream_interval reached the server: the first token alone, then at most one chunk a
    # STREAM_INTERVAL tokens (fewer where a chunk's text is not whole yet).
    assert all(
        len(itl) <= math.ceil((n - 1) / STREAM_INTERVAL)
        for itl, n in zip(result["itls"], result["output_lens"], strict=True)
    )
    assert result["median_ttft_ms"] == pytest.approx(statistics.median(result["ttfts"]) * 1000)
    assert set(result["per_tier"]) == {r.tier for r in workload}
    assert sum(tier["completed"] for tier in result["per_tier"].values()) == 12


def test_bench_serve_sharegpt_through_chat(
    api_server: ServerProcess, tiny_llama: Path, tmp_path: Path
) -> None:
    """A ShareGPT file through the chat backend; vLLM's default file name, and without --save-detailed no
    per-request detail."""
    conversations = [
        [
            {"from": "human", "value": f"Question number {i} about the weather and the sea?"},
            {"from": "gpt", "value": "Answer " * (i + 4)},
        ]
        for i in range(3)
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([{"conversations": turns} for turns in conversations]))
    args = [sys.executable, "-P", "-m", "kvfleet", "bench", "serve", "--backend", "openai-chat"]
    args += ["--host", "127.0.0.1", "--port", api_server.url.rsplit(":", 1)[1], "--dataset-name", "sharegpt"]
    args += [
        "--dataset-path",
        str(dataset),
        "--tokenizer",
        str(tiny_llama),
        "--num-prompts",
        "4",
        "--disable-tqdm",
    ]
    args += ["--max-concurrency", "2", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path / "out")]
    environment = {**os.environ, "OPENAI_API_KEY": api_server.api_key}
    completed = subprocess.run(
        args, capture_output=True, text=True, timeout=300, check=False, env=environment
    )
    assert completed.returncode == 0, completed.stderr
    assert "12/12" not in completed.stderr and "4/4" not in completed.stderr
    (path,) = (tmp_path / "out").iterdir()
    assert re.fullmatch(
        rf"openai-chat-infqps-concurrency2-{api_server.model_name}-\d{{8}}-\d{{6}}\.json", path.name
    )
    text = path.read_text()
    assert api_server.api_key not in text
    result = json.loads(text)
    assert set(result) == SETUP_KEYS | (RESULT_KEYS - DETAILED_KEYS) | metric_keys(
        ["ttft", "tpot", "itl"], ["99"]
    )
    assert result["completed"] == 4 and result["request_goodput"] is None
    # Each request runs to its answer's token count (--ignore-eos): the 3 answers, and one of them again.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    answers = [len(tokenizer(turns[1]["value"]).input_ids) for turns in conversations]
    assert result["total_output_tokens"] - sum(answers) in answers


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
