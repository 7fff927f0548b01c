"""Statistics of a serving benchmark under vLLM's `bench serve` names, overall and per SLA tier; its report.

Every latency statistic is in milliseconds over the successful requests: `mean_`, `median_`, `std_`
(population) and `pNN_` (linear interpolation between ranks, numpy's default) of each chosen metric, 0 where
there is no value, as vLLM writes them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The metrics vLLM reports percentiles of; the last two only when a client concurrency cap makes requests
# wait on the client (and, for the last, only at a finite rate).
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    tier: str
    prompt_len: int
    output_tokens: int = 0
    # Seconds: to the first streamed text, between successive text chunks, and to the end.
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    error: str | None = None
    # Seconds after the run's start at which it was sent, and how long it waited on the client's cap first.
    start_time: float = 0.0
    queue_time: float = 0.0
    generated_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)  # type: ignore[operator]


@dataclass(frozen=True)
class MetricSelection:
    """What a summary reports: percentiles of these metrics, and goodput under these SLOs (milliseconds)."""

    metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)


_METRIC_VALUES: dict[str, Callable[[list[RequestResult]], list[float]]] = {
    "ttft": lambda ok: [r.ttft for r in ok if r.ttft is not None],
    "tpot": lambda ok: [t for r in ok if (t := r.tpot) is not None],
    "itl": lambda ok: [gap for r in ok for gap in r.itl],
    "e2el": lambda ok: [r.latency for r in ok if r.latency is not None],
    "client_queue_time": lambda ok: [r.queue_time for r in ok],
    "e2el_including_client_queue": lambda ok: [r.latency + r.queue_time for r in ok if r.latency is not None],
}


def percentile_word(p: float) -> str:
    """99.0 -> `99`, 99.9 -> `99.9`: how a percentile is spelled in a key (`p99_ttft_ms`)."""
    return str(int(p)) if int(p) == p else str(p)


def metric_stats(results: list[RequestResult], selection: MetricSelection) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    stats: dict[str, float] = {}
    for metric in selection.metrics:
        values_ms = np.asarray(_METRIC_VALUES[metric](ok) or [0.0]) * 1000
        stats[f"mean_{metric}_ms"] = float(np.mean(values_ms))
        stats[f"median_{metric}_ms"] = float(np.median(values_ms))
        stats[f"std_{metric}_ms"] = float(np.std(values_ms))
        for p in selection.percentiles:
            stats[f"p{percentile_word(p)}_{metric}_ms"] = float(np.percentile(values_ms, p))
    return stats


def good_requests(results: list[RequestResult], slos_ms: dict[str, float]) -> int:
    """Successful requests within every SLO; a request of one output token has a TPOT of 0, as in vLLM."""
    measures: dict[str, Callable[[RequestResult], float]] = {
        "ttft": lambda r: r.ttft or 0.0,
        "tpot": lambda r: r.tpot or 0.0,
        "e2el": lambda r: r.latency or 0.0,
    }
    return sum(all(measures[name](r) <= slo / 1000 for name, slo in slos_ms.items()) for r in results if r.ok)


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """The most text chunks received in one second of the run, and the most requests in flight in one."""
    if not ok:
        return 0.0, 0
    origin = min(r.start_time for r in ok)
    chunks: Counter[int] = Counter()
    in_flight: Counter[int] = Counter()
    for r in ok:
        arrival = r.start_time + (r.ttft or 0.0)
        for gap in [0.0, *r.itl]:
            arrival += gap
            chunks[int(arrival - origin)] += 1
        end = r.start_time + (r.latency or 0.0)
        for second in range(int(r.start_time - origin), int(end - origin) + 1):
            in_flight[second] += 1
    return float(max(chunks.values(), default=0)), max(in_flight.values())


def summarize(
    results: list[RequestResult], duration: float, selection: MetricSelection | None = None
) -> dict[str, Any]:
    """vLLM's aggregate results of a run (its per-request lists are `per_request_fields`), and kvfleet's
    `per_tier` breakdown when requests carry SLA tiers."""
    selection = selection or MetricSelection()
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    peak_output, peak_requests = _peaks(ok)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": good_requests(results, selection.goodput) / duration
        if selection.goodput
        else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": peak_output,
        "max_concurrent_requests": peak_requests,
        # Audio seconds per wall second: no audio is sent.
        "rtfx": 0.0,
        **metric_stats(results, selection),
    }
    tiers = sorted({r.tier for r in results})
    if tiers and tiers != ["-"]:
        summary["per_tier"] = {
            tier: _tier_summary([r for r in results if r.tier == tier], selection) for tier in tiers
        }
    return summary


def _tier_summary(results: list[RequestResult], selection: MetricSelection) -> dict[str, Any]:
    completed = sum(r.ok for r in results)
    return {"completed": completed, "failed": len(results) - completed, **metric_stats(results, selection)}


def per_request_fields(results: list[RequestResult], detailed: bool) -> dict[str, list[Any]]:
    """The per-request lists of vLLM's result file: latencies and client queue times always, the rest with
    --save-detailed. A failed request counts 0 output tokens and 0 s to its first token, as in vLLM."""
    fields: dict[str, list[Any]] = {
        "latencies": [r.latency or 0.0 for r in results],
        "queue_times": [r.queue_time for r in results],
    }
    if detailed:
        fields |= {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens if r.ok else 0 for r in results],
            "ttfts": [r.ttft or 0.0 for r in results],
            "itls": [r.itl for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error or "" for r in results],
        }
    return fields


def failure_reasons(results: list[RequestResult]) -> dict[str, int]:
    return dict(Counter(r.error or "incomplete" for r in results if not r.ok))


_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
    "client_queue_time": ("Client-side Queueing", "Client Queue Time"),
    "e2el_including_client_queue": ("Queue-inclusive End-to-end Latency", "E2EL incl. Client Queue"),
}


def _line(name: str, value: object, fmt: str = "{:.2f}") -> str:
    text = "n/a" if value is None else fmt.format(value) if isinstance(value, float) else str(value)
    return f"{name:<40}{text:>12}"


def print_report(
    label: str,
    summary: dict[str, Any],
    selection: MetricSelection,
    failures: dict[str, int],
    traffic: Sequence[tuple[str, object]] = (),
) -> None:
    width = 52
    print(f" Serving Benchmark Result {label} ".center(width, "="))
    print(_line("Successful requests:", summary["completed"]))
    print(_line("Failed requests:", summary["failed"]))
    for reason, count in sorted(failures.items()):
        print(_line(f"  {reason}:", count))
    for name, value in traffic:
        print(_line(name, value))
    print(_line("Benchmark duration (s):", summary["duration"]))
    print(_line("Total input tokens:", summary["total_input_tokens"]))
    print(_line("Total generated tokens:", summary["total_output_tokens"]))
    print(_line("Request throughput (req/s):", summary["request_throughput"]))
    if summary["request_goodput"] is not None:
        print(_line("Request goodput (req/s):", summary["request_goodput"]))
    print(_line("Output token throughput (tok/s):", summary["output_throughput"]))
    print(_line("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"]))
    print(_line("Peak concurrent requests:", summary["max_concurrent_requests"]))
    print(_line("Total token throughput (tok/s):", summary["total_token_throughput"]))
    for metric in selection.metrics:
        title, short = _TITLES[metric]
        print(f" {title} ".center(width, "-"))
        print(_line(f"Mean {short} (ms):", summary[f"mean_{metric}_ms"]))
        print(_line(f"Median {short} (ms):", summary[f"median_{metric}_ms"]))
        for p in selection.percentiles:
            word = percentile_word(p)
            print(_line(f"P{word} {short} (ms):", summary[f"p{word}_{metric}_ms"]))
    if summary.get("per_tier"):
        _print_tiers(summary["per_tier"], selection, width)
    print("=" * width)


def _print_tiers(per_tier: dict[str, dict[str, Any]], selection: MetricSelection, width: int) -> None:
    """TTFT and TPOT of each SLA tier (where they were measured), at the chosen percentiles."""
    print(" Per SLA tier ".center(width, "-"))
    columns = [(m, "median") for m in ("ttft", "tpot") if m in selection.metrics]
    columns += [
        (m, f"p{percentile_word(p)}")
        for m in ("ttft", "tpot")
        if m in selection.metrics
        for p in selection.percentiles
    ]
    print(f"{'tier':<10}{'ok':>5}{'failed':>8}" + "".join(f"{f'{m.upper()} {s}':>13}" for m, s in columns))
    for tier, stats in per_tier.items():
        cells = "".join(f"{stats[f'{s}_{m}_ms']:>13.1f}" for m, s in columns)
        print(f"{tier:<10}{stats['completed']:>5}{stats['failed']:>8}" + cells)
