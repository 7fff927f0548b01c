"""`kvfleet bench batch`: offline `run-batch` against the same rows sent to `kvfleet serve` by a concurrent
client, and the time to first token of interactive requests with and without a Batch API batch beside them.

One seeded workload (`kvfleet bench serve`'s random token-id prompts) serves every part, so the rows are the
same everywhere, and prefix caching is off so that no part gains from an earlier one. Throughput is output
tokens per second from the first request to the last answer; model loading is outside every timing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from kvfleet.runtime.bench.processes import MODEL_NAME, ServeProcess
from kvfleet.runtime.bench.serve import BenchSettings
from kvfleet.runtime.bench.serve_client import build_workload, run_benchmark
from kvfleet.runtime.bench.serve_report import MetricSelection, summarize
from kvfleet.runtime.config import EngineConfig

_POLL_S = 0.2
_BATCH_COPIES = 8
TTFT_MEDIAN_AND_P99 = MetricSelection(("ttft",), (99.0,))


def batch_rows(settings: BenchSettings, vocab_size: int) -> list[dict[str, Any]]:
    """The workload as OpenAI batch lines: the same prompts and lengths `bench serve` sends."""
    return [
        {
            "custom_id": f"row-{index}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL_NAME,
                "prompt": request.prompt_token_ids,
                "max_tokens": request.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        for index, request in enumerate(build_workload(settings, vocab_size))
    ]


def run_batch_throughput(rows_path: Path, config: EngineConfig, workdir: Path) -> dict[str, float]:
    from kvfleet.runtime.batch.offline import run_batch

    summary = run_batch(
        rows_path,
        workdir / "answers.jsonl",
        input_format="jsonl",
        config=config,
        served_model_name=MODEL_NAME,
        progress=False,
    )
    return {
        "seconds": summary.seconds,
        "rows": summary.answered,
        "output_tokens": summary.output_tokens,
        "output_throughput": summary.output_tokens / summary.seconds,
    }


def serve_throughput(settings: BenchSettings, concurrency: int) -> dict[str, float]:
    run = asyncio.run(run_benchmark(replace(settings, max_concurrency=concurrency)))
    summary = summarize(run.results, run.duration)
    return {
        "concurrency": concurrency,
        "seconds": run.duration,
        "completed": summary["completed"],
        "output_throughput": summary["output_throughput"],
    }


def interactive_ttft(settings: BenchSettings) -> dict[str, Any]:
    run = asyncio.run(run_benchmark(settings))
    summary = summarize(run.results, run.duration, TTFT_MEDIAN_AND_P99)
    return {
        "completed": summary["completed"],
        "median_ttft_ms": summary["median_ttft_ms"],
        "p99_ttft_ms": summary["p99_ttft_ms"],
        "seconds": run.duration,
    }


def ttft_beside_a_batch(
    server: ServeProcess, interactive: BenchSettings, rows: list[dict[str, Any]], mean_output_len: float
) -> dict[str, Any]:
    """The interactive run while a batch of `rows` runs on the same server; the batch's throughput over the
    same time (answered lines x their mean output length)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = "".join(json.dumps(row) + "\n" for row in rows).encode()
        file_id = client.post("/v1/files", files={"file": ("rows.jsonl", body)}, data={"purpose": "batch"})
        file_id.raise_for_status()
        created = client.post(
            "/v1/batches",
            json={
                "input_file_id": file_id.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_id = created.json()["id"]

        def progress() -> tuple[str, int]:
            batch = client.get(f"/v1/batches/{batch_id}").json()
            return batch["status"], batch["request_counts"]["completed"]

        while progress()[1] == 0:
            time.sleep(_POLL_S)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _, before = progress()
            start = time.perf_counter()
            running = pool.submit(interactive_ttft, interactive)
            status, answered = progress()
            # The batch's window ends with the interactive load, or earlier if the batch runs out of lines.
            while not running.done() and status == "in_progress":
                time.sleep(_POLL_S)
                status, answered = progress()
            seconds = time.perf_counter() - start
            measured = running.result()
        if status in ("validating", "in_progress"):
            client.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
    return {
        **measured,
        "batch_lines": answered - before,
        "batch_output_throughput": (answered - before) * mean_output_len / seconds,
        "batch_finished_early": status != "in_progress",
    }


def run_batch_bench(
    config: EngineConfig,
    *,
    settings: BenchSettings,
    concurrencies: list[int],
    interactive: BenchSettings,
    vocab_size: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    # Every part sends the same prompts: cached prefixes would favour whichever part runs later.
    config = config.replace(enable_prefix_caching=False)
    rows = batch_rows(settings, vocab_size)
    mean_output_len = sum(row["body"]["max_tokens"] for row in rows) / len(rows)
    report: dict[str, Any] = {"rows": len(rows), "load_average": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-batch-") as temp:
        workdir = Path(temp)
        rows_path = workdir / "rows.jsonl"
        rows_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        log(f"run-batch: {len(rows)} rows")
        report["run_batch"] = run_batch_throughput(rows_path, config, workdir)
        server = ServeProcess(config, workdir, ["--batch-store", str(workdir / "store")])
        try:
            server.wait_ready()
            url_settings = replace(settings, base_url=server.url, model=MODEL_NAME)
            report["serve"] = []
            for concurrency in concurrencies:
                log(f"serve: the same rows at concurrency {concurrency}")
                report["serve"].append(serve_throughput(url_settings, concurrency))
            interactive = replace(interactive, base_url=server.url, model=MODEL_NAME)
            log("interactive TTFT, idle server")
            report["interactive_alone"] = interactive_ttft(interactive)
            log("interactive TTFT beside a batch")
            # Copies of the rows, so that the batch outlasts the interactive load.
            copies = [
                {**row, "custom_id": f"copy-{copy}-{row['custom_id']}"}
                for copy in range(_BATCH_COPIES)
                for row in rows
            ]
            report["interactive_with_batch"] = ttft_beside_a_batch(
                server, interactive, copies, mean_output_len
            )
        finally:
            server.stop()
    report["load_average_after"] = os.getloadavg()[0]
    return report


def format_report(report: dict[str, Any]) -> str:
    offline = report["run_batch"]["output_throughput"]
    best = max(report["serve"], key=lambda run: run["output_throughput"])
    lines = [
        f"{report['rows']} rows; load average {report['load_average']:.2f} before, "
        f"{report['load_average_after']:.2f} after",
        "",
        "| path | rows answered | output tokens/s |",
        "| --- | --- | --- |",
        f"| `kvfleet run-batch` | {report['run_batch']['rows']} | {offline:.1f} |",
    ]
    for run in report["serve"]:
        lines.append(
            f"| `kvfleet serve`, concurrency {run['concurrency']} | {run['completed']} | "
            f"{run['output_throughput']:.1f} |"
        )
    lines += [
        "",
        f"run-batch / best serve (concurrency {best['concurrency']}): "
        f"{offline / best['output_throughput']:.2f}x",
        "",
    ]
    alone, beside = report["interactive_alone"], report["interactive_with_batch"]
    lines += [
        "| interactive | TTFT p50 ms | TTFT p99 ms |",
        "| --- | --- | --- |",
        f"| alone | {_ms(alone['median_ttft_ms'])} | {_ms(alone['p99_ttft_ms'])} |",
        f"| beside a batch | {_ms(beside['median_ttft_ms'])} | {_ms(beside['p99_ttft_ms'])} |",
        "",
        f"batch throughput beside the interactive load: {beside['batch_output_throughput']:.1f} output "
        f"tokens/s ({beside['batch_output_throughput'] / best['output_throughput']:.0%} of the best serve "
        "throughput on an idle server)"
        + (" (the batch finished early)" if beside["batch_finished_early"] else ""),
    ]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
