"""Statistics of a serving benchmark, overall and per SLA tier, printed the way vLLM's `bench serve` does."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


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

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)  # type: ignore[operator]


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(value * 1000 for value in values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
    }


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), on sorted values."""
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _latencies(results: list[RequestResult]) -> dict[str, dict[str, float | None]]:
    ok = [r for r in results if r.ok]
    return {
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": _stats_ms([r.latency for r in ok if r.latency is not None]),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    tiers = sorted({r.tier for r in results})
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": dict(Counter(r.error or "incomplete" for r in results if not r.ok)),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **_latencies(results),
        "per_tier": {
            tier: {
                "completed": sum(r.ok for r in results if r.tier == tier),
                "failed": sum(not r.ok for r in results if r.tier == tier),
                **_latencies([r for r in results if r.tier == tier]),
            }
            for tier in tiers
            if len(tiers) > 1 or tier != "-"
        },
    }


def _line(name: str, value: object, fmt: str = "{:.2f}") -> str:
    text = "n/a" if value is None else fmt.format(value) if isinstance(value, float) else str(value)
    return f"{name:<40}{text:>12}"


def print_report(label: str, summary: dict[str, Any]) -> None:
    width = 52
    print(f" Serving Benchmark Result {label} ".center(width, "="))
    print(_line("Successful requests:", summary["completed"]))
    for reason, count in sorted(summary["failed"].items()):
        print(_line(f"Failed requests ({reason}):", count))
    print(_line("Benchmark duration (s):", summary["duration_s"]))
    print(_line("Total input tokens:", summary["input_tokens"]))
    print(_line("Total generated tokens:", summary["output_tokens"]))
    print(_line("Request throughput (req/s):", summary["request_throughput"]))
    print(_line("Output token throughput (tok/s):", summary["output_throughput"]))
    print(_line("Total token throughput (tok/s):", summary["total_token_throughput"]))
    titles = {
        "ttft_ms": ("Time to First Token", "TTFT"),
        "tpot_ms": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl_ms": ("Inter-token Latency", "ITL"),
        "e2e_ms": ("End-to-end Latency", "E2EL"),
    }
    for key, (title, short) in titles.items():
        print(f" {title} ".center(width, "-"))
        for stat, name in (("mean", "Mean"), ("p50", "Median"), ("p99", "P99")):
            print(_line(f"{name} {short} (ms):", summary[key][stat]))
    if summary["per_tier"]:
        print(" Per SLA tier ".center(width, "-"))
        print(f"{'tier':<10}{'ok':>5}{'failed':>8}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'TPOT p50':>10}")
        for tier, stats in summary["per_tier"].items():
            ttft, tpot = stats["ttft_ms"], stats["tpot_ms"]
            cells = [
                _fmt(ttft["mean"], 11),
                _fmt(ttft["p50"], 9),
                _fmt(ttft["p99"], 9),
                _fmt(tpot["p50"], 10),
            ]
            print(f"{tier:<10}{stats['completed']:>5}{stats['failed']:>8}" + "".join(cells))
    print("=" * width)


def _fmt(value: float | None, width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.1f}"
