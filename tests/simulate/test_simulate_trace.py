"""Traces: files read back as written, refused when malformed, and generated shapes that look as asked."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from kvfleet.simulate.trace import TraceRequest, TraceShapeSpec, generate, read_trace, write_trace


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_written_trace_reads_back_the_same(tmp_path: Path, suffix: str) -> None:
    requests = list(generate(TraceShapeSpec("multi-tenant", duration_s=20, base_rate=5, seed=3)))
    path = tmp_path / f"trace{suffix}"
    assert write_trace(requests, path) == len(requests) > 50
    assert list(read_trace(path)) == requests
    assert {request.tier for request in requests} == {"critical", "standard", "batch"}


def test_a_request_arriving_before_the_one_ahead_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    write_trace([TraceRequest(2.0, 10, 5), TraceRequest(1.0, 10, 5)], path)
    with pytest.raises(ValueError, match="request 2 arrives before"):
        list(read_trace(path))
    path.write_text("arrival_s,prompt_tokens,output_tokens,tier\n0,10,5,urgent\n")
    with pytest.raises(ValueError, match=r"trace.csv:1: unknown tier 'urgent'"):
        list(read_trace(path))


def test_a_burst_arrives_at_its_ratio_of_the_base_rate_and_the_generator_streams() -> None:
    spec = TraceShapeSpec("burst", duration_s=600, base_rate=20, peak_ratio=10, burst_start_s=300)
    requests = generate(spec)
    assert isinstance(requests, types.GeneratorType)
    in_burst = outside = 0
    for request in requests:
        if 300 <= request.arrival_s < 360:
            in_burst += 1
        else:
            outside += 1
    # 60 s at 200/s, and 540 s at 20/s; Poisson counts this large stay within a few percent.
    assert in_burst == pytest.approx(12000, rel=0.05)
    assert outside == pytest.approx(10800, rel=0.05)


def test_a_diurnal_trace_peaks_in_its_middle() -> None:
    spec = TraceShapeSpec("diurnal", duration_s=1000, base_rate=10, peak_ratio=5)
    arrivals = [request.arrival_s for request in generate(spec)]
    edge = sum(1 for time in arrivals if time < 100)
    middle = sum(1 for time in arrivals if 450 <= time < 550)
    # The rate is 10 + 40 (1 - cos(2 pi t / T)) / 2: about 11 per second near the start, 50 at the middle.
    assert middle / edge == pytest.approx(49.0 / 11.3, rel=0.15)
