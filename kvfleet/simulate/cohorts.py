"""Cohorts: a trace's arrivals counted per time span, tier and prefix group, for the cohort model.

A cohort stands for the requests of one tier and prefix group that arrive within one span: how many, and
their prompt and output tokens added up. A trace file is read request by request and counted (as slow as
reading it); a generated shape is drawn as cohorts directly, never request by request: each span's arrivals
per tenant and prefix group are Poisson with the mean the shape's rate curve gives over the span (the
trace generator's thinning draws the same process), and a cohort's token sums are the sums of its lengths'
lognormal draws, taken as normal (their mean and spread times the count), which they are near from a few
requests on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy

from kvfleet.simulate.trace import LENGTH_SIGMA, TraceRequest, TraceShapeSpec, rate_curve, tenants

# Points per span at which the rate curve is read to integrate it (midpoints): a burst's edge within a
# span is then placed to an eighth of the span.
_RATE_POINTS = 8


@dataclass(frozen=True)
class Cohort:
    """The requests of one tier and prefix group arriving within [start_s, start_s + span_s)."""

    start_s: float
    span_s: float
    tier: str
    prefix_group: str
    count: int
    prompt_tokens: int
    output_tokens: int


def cohorts_of(requests: Iterable[TraceRequest], span_s: float) -> Iterator[list[Cohort]]:
    """The requests counted into cohorts, one list per span that has arrivals, in time order."""
    current: int | None = None
    sums: dict[tuple[str, str], list[int]] = {}
    for request in requests:
        index = math.floor(request.arrival_s / span_s)
        if index != current:
            if current is not None:
                yield _cohorts(current, span_s, sums)
            current, sums = index, {}
        counted = sums.setdefault((request.tier, request.prefix_group), [0, 0, 0])
        counted[0] += 1
        counted[1] += request.prompt_tokens
        counted[2] += request.output_tokens
    if current is not None:
        yield _cohorts(current, span_s, sums)


def _cohorts(index: int, span_s: float, sums: dict[tuple[str, str], list[int]]) -> list[Cohort]:
    return [
        Cohort(index * span_s, span_s, tier, group, count, prompt, output)
        for (tier, group), (count, prompt, output) in sums.items()
    ]


def generate_cohorts(spec: TraceShapeSpec, span_s: float) -> Iterator[list[Cohort]]:
    """The cohorts of a generated trace of `spec`'s shape, one list per span that has arrivals."""
    rng = numpy.random.default_rng(spec.seed)
    rate, _ = rate_curve(spec)
    mix = tenants(spec)
    cells = [
        (
            tier,
            f"{tier}-{group}",
            spec.mean_prompt_tokens * prompt_scale,
            spec.mean_output_tokens * output_scale,
        )
        for tier, prompt_scale, output_scale, groups in mix
        for group in range(groups)
    ]
    # A request picks its tenant, then its group, uniformly.
    shares = numpy.array(
        [1 / (len(mix) * groups) for _, _, _, groups in mix for _ in range(groups)], dtype=float
    )
    prompt_means = numpy.array([cell[2] for cell in cells])
    output_means = numpy.array([cell[3] for cell in cells])
    # A lognormal length's standard deviation over its mean.
    spread = math.sqrt(math.exp(LENGTH_SIGMA**2) - 1)
    spans = math.ceil(spec.duration_s / span_s)
    for index in range(spans):
        start = index * span_s
        length = min(span_s, spec.duration_s - start)
        expected = length * _mean_rate(rate, start, length)
        counts = rng.poisson(expected * shares)
        if not counts.any():
            continue
        roots = numpy.sqrt(counts)
        prompts = counts * prompt_means + roots * prompt_means * spread * rng.standard_normal(len(cells))
        outputs = counts * output_means + roots * output_means * spread * rng.standard_normal(len(cells))
        yield [
            Cohort(
                start, length, cells[cell][0], cells[cell][1], count, max(count, prompt), max(count, output)
            )
            for cell, count, prompt, output in zip(
                range(len(cells)),
                counts.tolist(),
                numpy.rint(prompts).astype(int).tolist(),
                numpy.rint(outputs).astype(int).tolist(),
                strict=True,
            )
            if count
        ]


def _mean_rate(rate: Callable[[float], float], start: float, length: float) -> float:
    step = length / _RATE_POINTS
    return sum(rate(start + (point + 0.5) * step) for point in range(_RATE_POINTS)) / _RATE_POINTS
