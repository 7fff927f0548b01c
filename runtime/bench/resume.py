"""`kvfleet bench resume`: what a replica failing mid-stream costs when the gateway resumes its streams.

Replicas (`kvfleet serve`) and one `kvfleet gateway` in front of them run as local processes. Long greedy
completions stream through the gateway, all at once; when the streams have received a given share of their
tokens, one replica is stopped: SIGKILL (a crash: the gateway sees its connections reset) or SIGTERM with
no drain time (a drain: the replica hands its streams back with the `draining` error event). The gateway
resumes each stream it held on another replica from the tokens already sent.

Reported, for each round (a fresh fleet each):
- the resume latency, failure to next token, as the gateway measures it (its `kvfleet_gateway_resume_seconds`
  histogram, quantiles interpolated in its buckets as Prometheus does) and as the clients see it: for the
  streams the stop hit, the time from the stop to their next token;
- the extra prefill work: the tokens the gateway replayed (`kvfleet_gateway_resumed_tokens_total`) and those
  the replicas prefilled again for continuations (`kvfleet:resumed_tokens_total`), against the tokens the
  streams generated;
- whether every stream completed, with exactly the tokens it asked for (token ids counted as they arrive: a
  token sent twice or lost shows).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from kvfleet.runtime.bench.processes import MODEL_NAME, BenchProcess, ServeProcess, counter_totals
from kvfleet.runtime.bench.serve_client import bench_client
from kvfleet.runtime.config import EngineConfig
from prometheus_client.parser import text_string_to_metric_families

StopSignal = Literal["kill", "term"]
STOP_SIGNALS: dict[str, signal.Signals] = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
# The gateway's resume metrics (samples' names) and the replicas' counters (kvfleet_ names without their
# prefix and _total, as counter_totals reads them).
RESUMES = "kvfleet_gateway_resumes_total"
RESUMED_TOKENS = "kvfleet_gateway_resumed_tokens_total"
RESUME_SECONDS = "kvfleet_gateway_resume_seconds"
REPLICA_COUNTERS = ("resumed_requests", "resumed_tokens")
_PROGRESS_POLL_S = 0.01


@dataclass(frozen=True)
class ResumeSettings:
    replicas: int = 3
    streams: int = 24
    prompt_len: int = 256
    output_len: int = 256
    # The replica is stopped once the streams have received this share of all their tokens.
    stop_at: float = 0.5
    stop: StopSignal = "kill"
    rounds: int = 1
    seed: int = 0


@dataclass
class StreamTrace:
    """One stream as its client saw it: when each chunk carrying tokens arrived (perf_counter seconds), the
    token ids received, and how it ended."""

    arrivals: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def resume_prompts(settings: ResumeSettings, vocab_size: int, round_index: int) -> list[list[int]]:
    """Each stream's prompt token ids, from the seed; ids skip the first 16 (special) ids. A round's prompts
    are its own, so no round finds another's prefixes cached."""
    rng = random.Random(settings.seed * 1_000_003 + round_index)
    return [
        [rng.randrange(16, vocab_size) for _ in range(settings.prompt_len)] for _ in range(settings.streams)
    ]


def waits_after_stop(traces: Iterable[StreamTrace], stopped_at: float, resumed: int) -> list[float]:
    """The client-side resume latencies: among the streams that had tokens before the stop and got more
    after it, the `resumed` longest waits from the stop to their next token (the streams the stop hit wait
    for a failure to be noticed and a prefill elsewhere; the others only for their next step), sorted."""
    waits = []
    for trace in traces:
        if not any(arrival <= stopped_at for arrival in trace.arrivals):
            continue
        after = next((arrival for arrival in trace.arrivals if arrival > stopped_at), None)
        if after is not None:
            waits.append(after - stopped_at)
    waits.sort()
    return waits[max(0, len(waits) - resumed) :] if resumed > 0 else []


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of a histogram given as (upper bound, cumulative count) pairs, interpolated
    linearly within its bucket as Prometheus's histogram_quantile does; the highest finite bound when it
    falls in the +Inf bucket; None for an empty histogram."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def gateway_resume_figures(metrics_text: str) -> dict[str, Any]:
    """The gateway's resumes by cause, tokens replayed and resume-latency buckets, summed over the other
    labels."""
    by_cause: dict[str, float] = {}
    replayed = 0.0
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == RESUMES:
                cause = sample.labels.get("cause", "")
                by_cause[cause] = by_cause.get(cause, 0.0) + sample.value
            elif sample.name == RESUMED_TOKENS:
                replayed += sample.value
            elif sample.name == RESUME_SECONDS + "_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return {"resumes": by_cause, "replayed_tokens": replayed, "buckets": sorted(buckets.items())}


def summarize_round(
    traces: list[StreamTrace], stopped_at: float, gateway: dict[str, Any], replicas: dict[str, float]
) -> dict[str, Any]:
    """One round's figures (see the module's docstring); latencies in milliseconds."""
    resumed = round(sum(gateway["resumes"].values()))
    client_waits = [wait * 1000 for wait in waits_after_stop(traces, stopped_at, resumed)]
    generated = sum(len(trace.token_ids) for trace in traces)
    return {
        "streams": len(traces),
        "complete": sum(trace.error is None and trace.finish_reason is not None for trace in traces),
        "errors": sorted(trace.error for trace in traces if trace.error is not None),
        "token_counts": sorted({len(trace.token_ids) for trace in traces}),
        "resumes": gateway["resumes"],
        "gateway_resume_ms": {
            f"p{round(q * 100)}": None if value is None else value * 1000
            for q in (0.5, 0.99)
            for value in [histogram_quantile(q, gateway["buckets"])]
        },
        "client_resume_ms": {
            f"p{q}": float(np.percentile(client_waits, q)) if client_waits else None for q in (50, 99)
        },
        "generated_tokens": generated,
        "gateway_replayed_tokens": gateway["replayed_tokens"],
        "replica_resumed_tokens": replicas["resumed_tokens"],
        "replica_resumed_requests": replicas["resumed_requests"],
    }


def run_resume_bench(
    config: EngineConfig, settings: ResumeSettings, *, vocab_size: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Each round on a fresh fleet; the report with every round's figures."""
    report: dict[str, Any] = {"settings": asdict(settings), "load_average": os.getloadavg(), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-resume-") as temp:
        for index in range(settings.rounds):
            fleet = f"{settings.replicas} replicas, {settings.streams} streams"
            log(f"round {index + 1}: {fleet}, stopping one with {settings.stop}")
            workdir = Path(temp) / f"round-{index}"
            workdir.mkdir()
            prompts = resume_prompts(settings, vocab_size, index)
            report["rounds"].append(_run_round(config, settings, workdir, prompts, index))
    report["load_average_after"] = os.getloadavg()
    return report


def _run_round(
    config: EngineConfig, settings: ResumeSettings, workdir: Path, prompts: list[list[int]], index: int
) -> dict[str, Any]:
    # No drain time: a SIGTERM hands every stream back at once.
    servers = [
        ServeProcess(
            config,
            workdir,
            ["--shutdown-timeout", "0"],
            log_name=f"replica-{number}.log",
            env={"OMP_NUM_THREADS": "1"},
        )
        for number in range(settings.replicas)
    ]
    urls = ",".join(server.url for server in servers)
    gateway = BenchProcess(
        ["gateway", "--model", f"{MODEL_NAME}={urls}"], workdir / "gateway.log", ready_path="/health"
    )
    processes: list[BenchProcess] = [*servers, gateway]
    victim = servers[index % len(servers)]
    try:
        for process in processes:
            process.wait_ready()
        traces, stopped_at = asyncio.run(_stream_and_stop(gateway.url, prompts, settings, victim))
        gateway_figures = gateway_resume_figures(httpx.get(gateway.url + "/metrics", timeout=10).text)
        survivors = [server.url for server in servers if server is not victim]
        replica_figures = counter_totals(survivors, REPLICA_COUNTERS)
    finally:
        for process in reversed(processes):
            process.stop()
    return summarize_round(traces, stopped_at, gateway_figures, replica_figures)


async def _stream_and_stop(
    url: str, prompts: list[list[int]], settings: ResumeSettings, victim: BenchProcess
) -> tuple[list[StreamTrace], float]:
    """Every stream at once; the victim stopped once the streams received settings.stop_at of their tokens.
    The traces, and when the victim was stopped."""
    traces = [StreamTrace() for _ in prompts]
    async with bench_client(url, len(prompts), timeout=600.0) as client:
        tasks = [
            asyncio.create_task(_stream(client, prompt, settings.output_len, trace))
            for prompt, trace in zip(prompts, traces, strict=True)
        ]
        wanted = settings.stop_at * settings.output_len * len(prompts)
        while sum(len(trace.token_ids) for trace in traces) < wanted and not all(t.done() for t in tasks):
            await asyncio.sleep(_PROGRESS_POLL_S)
        stopped_at = time.perf_counter()
        os.kill(victim.process.pid, STOP_SIGNALS[settings.stop])
        await asyncio.gather(*tasks)
    return traces, stopped_at


async def _stream(client: httpx.AsyncClient, prompt: list[int], output_len: int, trace: StreamTrace) -> None:
    """One greedy completion streamed into `trace`; a failure is the trace's error, never an exception."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                trace.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    trace.error = chunk["error"].get("code") or chunk["error"].get("type") or "error"
                    return
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        trace.arrivals.append(time.perf_counter())
                        trace.token_ids += choice["token_ids"]
                    trace.finish_reason = choice.get("finish_reason") or trace.finish_reason
    except httpx.HTTPError as exc:
        trace.error = type(exc).__name__


def format_resume_report(report: dict[str, Any]) -> str:
    load, after = report["load_average"], report["load_average_after"]
    lines = [
        f"load average {load[0]:.2f} before, {after[0]:.2f} after",
        "",
        "| round | streams complete | resumes | gateway resume p50 / p99 ms | client resume p50 / p99 ms | "
        "generated tokens | replayed (gateway) | prefilled again (replicas) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pair(figures: dict[str, float | None]) -> str:
        return " / ".join("-" if value is None else f"{value:.0f}" for value in figures.values())

    for number, run in enumerate(report["rounds"], start=1):
        causes = ", ".join(f"{cause} {count:.0f}" for cause, count in sorted(run["resumes"].items())) or "0"
        cells = [
            str(number),
            f"{run['complete']}/{run['streams']}",
            causes,
            pair(run["gateway_resume_ms"]),
            pair(run["client_resume_ms"]),
            str(run["generated_tokens"]),
            f"{run['gateway_replayed_tokens']:.0f}",
            f"{run['replica_resumed_tokens']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for number, run in enumerate(report["rounds"], start=1):
        if run["errors"] or len(run["token_counts"]) != 1:
            lines.append(f"round {number}: errors {run['errors']}, token counts {run['token_counts']}")
    return "\n".join(lines)
