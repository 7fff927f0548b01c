"""Traces: the requests a simulated fleet is sent, read from a file or generated, one at a time.

A trace is a sequence of requests in arrival order, each with its arrival time in seconds from the start, its
prompt and output lengths in tokens, its tier and its prefix group (requests of one group share the start
of their prompt, a system prompt or a conversation's history). Files are CSV with a header row or JSON
Lines, with the fields named as TraceRequest's. Everything here is an iterator: a trace of a day is never
held in memory.

The generators draw Poisson arrivals at a rate that varies over time (by thinning: candidates at the peak
rate, each kept with the share of the peak the rate is then), so a burst or a diurnal swing arrives as a
real one would, with lognormal prompt and output lengths.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from kvfleet.contract.tiers import DEFAULT_TIER, TIER_NAMES

TraceShape = Literal["steady", "diurnal", "burst", "multi-tenant"]
TRACE_SHAPES: tuple[TraceShape, ...] = ("steady", "diurnal", "burst", "multi-tenant")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tier: str = DEFAULT_TIER
    prefix_group: str = ""


def read_trace(path: Path) -> Iterator[TraceRequest]:
    """The requests of a CSV (with a header) or JSON Lines file, in its order; arrivals must not go back."""
    with path.open() as source:
        rows: Iterable[dict[str, str]] = (
            csv.DictReader(source)
            if path.suffix == ".csv"
            else (json.loads(line) for line in source if line.strip())
        )
        previous = 0.0
        for number, row in enumerate(rows, start=1):
            request = _request(row, f"{path}:{number}")
            if request.arrival_s < previous:
                raise ValueError(f"{path}: request {number} arrives before the one ahead of it")
            previous = request.arrival_s
            yield request


def write_trace(requests: Iterable[TraceRequest], path: Path) -> int:
    """Writes the requests as CSV or JSON Lines (by the file's suffix); returns how many."""
    names = [field.name for field in fields(TraceRequest)]
    count = 0
    with path.open("w", newline="") as sink:
        writer = csv.DictWriter(sink, names) if path.suffix == ".csv" else None
        if writer is not None:
            writer.writeheader()
        for request in requests:
            row = asdict(request)
            if writer is not None:
                writer.writerow(row)
            else:
                sink.write(json.dumps(row) + "\n")
            count += 1
    return count


def _request(row: dict[str, str], where: str) -> TraceRequest:
    try:
        request = TraceRequest(
            arrival_s=float(row["arrival_s"]),
            prompt_tokens=int(row["prompt_tokens"]),
            output_tokens=int(row["output_tokens"]),
            tier=str(row.get("tier") or DEFAULT_TIER),
            prefix_group=str(row.get("prefix_group") or ""),
        )
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"{where}: not a request ({error})") from None
    if request.prompt_tokens < 1 or request.output_tokens < 1:
        raise ValueError(f"{where}: a request needs at least one prompt and one output token")
    if request.tier not in TIER_NAMES:
        raise ValueError(f"{where}: unknown tier {request.tier!r} (one of {', '.join(TIER_NAMES)})")
    return request


@dataclass(frozen=True)
class TraceShapeSpec:
    """What a generated trace looks like."""

    shape: TraceShape
    duration_s: float
    # The mean arrival rate at the trace's quietest (steady: its only) level.
    base_rate: float
    # diurnal: the peak's rate over the base rate; burst: the burst's.
    peak_ratio: float = 10.0
    # burst: when the burst starts and how long it lasts.
    burst_start_s: float = 0.0
    burst_length_s: float = 60.0
    mean_prompt_tokens: float = 512.0
    mean_output_tokens: float = 128.0
    prefix_groups: int = 16
    seed: int = 0


def generate(spec: TraceShapeSpec) -> Iterator[TraceRequest]:
    """Requests of the given shape, streamed in arrival order."""
    rng = random.Random(spec.seed)
    rate, peak = rate_curve(spec)
    mix = tenants(spec)
    time = 0.0
    while True:
        time += rng.expovariate(peak)
        if time >= spec.duration_s:
            return
        if rng.random() * peak > rate(time):
            continue
        tier, prompt_scale, output_scale, groups = mix[rng.randrange(len(mix))]
        yield TraceRequest(
            arrival_s=round(time, 6),
            prompt_tokens=_lognormal(rng, spec.mean_prompt_tokens * prompt_scale),
            output_tokens=_lognormal(rng, spec.mean_output_tokens * output_scale),
            tier=tier,
            prefix_group=f"{tier}-{rng.randrange(groups)}",
        )


def rate_curve(spec: TraceShapeSpec) -> tuple[Callable[[float], float], float]:
    """The arrival rate over time, and its peak."""
    base = spec.base_rate
    if spec.shape == "diurnal":
        # One day's swing over the trace: quietest at its start and end, the peak in its middle.
        swing = (spec.peak_ratio - 1) * base

        def diurnal(time: float) -> float:
            return base + swing * (1 - math.cos(2 * math.pi * time / spec.duration_s)) / 2

        return diurnal, base * spec.peak_ratio
    if spec.shape == "burst":
        end = spec.burst_start_s + spec.burst_length_s

        def burst(time: float) -> float:
            return base * spec.peak_ratio if spec.burst_start_s <= time < end else base

        return burst, base * spec.peak_ratio
    return (lambda time: base), base


def tenants(spec: TraceShapeSpec) -> list[tuple[str, float, float, int]]:
    """(tier, prompt scale, output scale, prefix groups) of each tenant; a request picks one at random."""
    if spec.shape != "multi-tenant":
        return [(DEFAULT_TIER, 1.0, 1.0, spec.prefix_groups)]
    # An interactive tenant with short exchanges, a standard one, and a batch tenant with long documents.
    return [
        ("critical", 0.5, 0.5, max(1, spec.prefix_groups // 4)),
        ("standard", 1.0, 1.0, spec.prefix_groups),
        ("batch", 3.0, 2.0, max(1, spec.prefix_groups // 2)),
    ]


# The spread of the lognormal lengths (the sigma of their logarithm).
LENGTH_SIGMA = 0.6


def _lognormal(rng: random.Random, mean: float, sigma: float = LENGTH_SIGMA) -> int:
    """A length with the given mean and a long tail."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
