"""What a simulated run reports: SLO attainment per tier, latency percentiles, replica-hours, scale events,
flaps and shed requests, with replicas and p90 time to first token over time; as JSON, and as a plot.

Latencies go into log-spaced histograms (buckets 1% apart), so a run's memory does not grow with its
requests; a percentile is read back within 1%. Attainment is counted exactly. The cohort model reports many
requests at once: a latency with how many requests had it, and counts that need not be whole.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy

_SMALLEST_S = 1e-4
_GROWTH = math.log(1.01)


def bucket_of(seconds: float) -> int:
    """The histogram's bucket of one latency."""
    return max(0, math.floor(math.log(max(seconds, _SMALLEST_S) / _SMALLEST_S) / _GROWTH))


def bucket_indices(seconds: numpy.ndarray) -> numpy.ndarray:
    """The histogram's bucket of each latency (as bucket_of() numbers one)."""
    ratios = numpy.maximum(seconds, _SMALLEST_S) / _SMALLEST_S
    return numpy.maximum(numpy.floor(numpy.log(ratios) / _GROWTH), 0).astype(numpy.int64)


class Histogram:
    """Latencies in seconds, in buckets 1% apart from 0.1 ms."""

    def __init__(self) -> None:
        self.buckets: Counter[int] = Counter()
        self.count = 0

    def add(self, bucket: int) -> None:
        """A latency, by its bucket (as bucket_of() numbers it)."""
        self.buckets[bucket] += 1
        self.count += 1

    def add_counts(self, counts: numpy.ndarray) -> None:
        """Observations by bucket (as bucket_indices() numbers them), counts that need not be whole."""
        for bucket in numpy.flatnonzero(counts).tolist():
            self.buckets[bucket] += float(counts[bucket])
        self.count += float(counts.sum())

    def percentile(self, share: float) -> float | None:
        """The latency `share` (0..1) of the samples are within, at its bucket's middle; None when empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(share * self.count))
        seen = 0.0
        # Counts that need not be whole may add up a rounding short of the total: the last bucket holds it.
        last = max(self.buckets)
        for bucket in sorted(self.buckets):
            seen += self.buckets[bucket]
            if seen >= rank or bucket == last:
                return _SMALLEST_S * math.exp((bucket + 0.5) * _GROWTH)
        raise AssertionError("the buckets hold count samples")


@dataclass
class TierResult:
    requests: int = 0
    within_target: int = 0
    shed: int = 0
    # Requests that waited in the gateway's queue for a replica's room.
    waited: int = 0
    ttft: Histogram = field(default_factory=Histogram)

    def summary(self) -> dict[str, Any]:
        served = self.requests - self.shed
        return {
            "requests": round(self.requests),
            "served": round(served),
            "within_ttft_target": round(self.within_target),
            # Shed requests count as missed: the client got no first token at all.
            "attainment": self.within_target / self.requests if self.requests else None,
            "shed": round(self.shed),
            "waited": round(self.waited),
            **_percentiles(self.ttft),
        }


@dataclass(frozen=True)
class ScaleEvent:
    time_s: float
    from_replicas: int
    to_replicas: int
    reason: str


@dataclass(frozen=True)
class SeriesPoint:
    """The fleet over one interval of the run."""

    time_s: float
    desired: int
    ready: int
    # Replicas costing money: starting, ready or draining.
    running: int
    arrivals: float
    ttft_p90_s: float | None


class RunReport:
    """Accumulates a run's figures as it goes."""

    def __init__(self, ttft_target_s: float, stable_window_s: float) -> None:
        self.ttft_target_s = ttft_target_s
        self.stable_window_s = stable_window_s
        self.tiers: dict[str, TierResult] = {}
        self.ttft = Histogram()
        self.scale_events: list[ScaleEvent] = []
        self.flaps = 0
        self.series: list[SeriesPoint] = []
        self.replica_seconds = 0.0
        self._last_scale_up: float | None = None
        self._interval_ttft = Histogram()
        self._interval_arrivals = 0

    def arrived(self, tier: str, count: float = 1) -> None:
        # A tier's result is made once, not (as setdefault's argument) at every arrival.
        result = self.tiers.get(tier)
        if result is None:
            result = self.tiers[tier] = TierResult()
        result.requests += count
        self._interval_arrivals += count

    def first_token(self, tier: str, ttft_s: float) -> None:
        result = self.tiers[tier]
        bucket = bucket_of(ttft_s)
        for histogram in (result.ttft, self.ttft, self._interval_ttft):
            histogram.add(bucket)
        if ttft_s <= self.ttft_target_s:
            result.within_target += 1

    def first_tokens(self, tier: str, counts: numpy.ndarray, within_target: float) -> None:
        """Requests of `tier` that got their first token, counted by latency bucket (bucket_indices()), and
        how many of them within the target."""
        result = self.tiers[tier]
        for histogram in (result.ttft, self.ttft, self._interval_ttft):
            histogram.add_counts(counts)
        result.within_target += within_target

    def shed(self, tier: str, count: float = 1) -> None:
        self.tiers[tier].shed += count

    def waited(self, tier: str, count: float = 1) -> None:
        self.tiers[tier].waited += count

    def gateway_counts(self) -> tuple[float, float, float]:
        """The requests that reached the gateway so far, those it shed and those that waited in its queue: its
        counters."""
        results = self.tiers.values()
        return (
            sum(result.requests for result in results),
            sum(result.shed for result in results),
            sum(result.waited for result in results),
        )

    def scaled(self, event: ScaleEvent) -> None:
        """A change of the replica count; a fall within the stable window of a rise is a flap."""
        self.scale_events.append(event)
        if event.to_replicas > event.from_replicas:
            self._last_scale_up = event.time_s
        elif self._last_scale_up is not None and event.time_s - self._last_scale_up < self.stable_window_s:
            self.flaps += 1

    def close_interval(self, time_s: float, desired: int, ready: int, running: int) -> None:
        self.series.append(
            SeriesPoint(
                time_s, desired, ready, running, self._interval_arrivals, self._interval_ttft.percentile(0.9)
            )
        )
        self._interval_ttft, self._interval_arrivals = Histogram(), 0

    def summary(self, simulated_s: float, wall_s: float, extra: dict[str, Any]) -> dict[str, Any]:
        requests = sum(result.requests for result in self.tiers.values())
        within = sum(result.within_target for result in self.tiers.values())
        shed = sum(result.shed for result in self.tiers.values())
        waited = sum(result.waited for result in self.tiers.values())
        return {
            "simulated_seconds": simulated_s,
            "wall_seconds": wall_s,
            "simulated_seconds_per_second": simulated_s / wall_s if wall_s > 0 else None,
            "ttft_target_seconds": self.ttft_target_s,
            "requests": round(requests),
            "attainment": within / requests if requests else None,
            "shed": round(shed),
            "waited": round(waited),
            **_percentiles(self.ttft),
            "replica_hours": self.replica_seconds / 3600,
            "peak_replicas": max((point.running for point in self.series), default=0),
            "scale_events": len(self.scale_events),
            "flaps": self.flaps,
            "tiers": {tier: result.summary() for tier, result in sorted(self.tiers.items())},
            **extra,
            "series": [asdict(point) for point in self.series],
            "scale_event_log": [asdict(event) for event in self.scale_events],
        }


def _percentiles(histogram: Histogram) -> dict[str, float | None]:
    return {f"ttft_p{share}_s": histogram.percentile(share / 100) for share in (50, 90, 99)}


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Replicas and p90 time to first token over time, one line per run (label -> its summary)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (replicas, latency) = pyplot.subplots(2, 1, sharex=True, figsize=(9, 6))
    for label, summary in runs.items():
        hours = [point["time_s"] / 3600 for point in summary["series"]]
        replicas.plot(hours, [point["running"] for point in summary["series"]], label=label)
        latency.plot(
            hours,
            [
                point["ttft_p90_s"] if point["ttft_p90_s"] is not None else math.nan
                for point in summary["series"]
            ],
            label=label,
        )
    target = next(iter(runs.values()))["ttft_target_seconds"]
    latency.axhline(target, color="grey", linestyle="--", label="TTFT target")
    replicas.set_ylabel("replicas (starting, ready, draining)")
    latency.set_ylabel("p90 TTFT (s)")
    latency.set_xlabel("simulated hours")
    replicas.legend()
    latency.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
