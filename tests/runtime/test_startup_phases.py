"""The start's phases: nested phases counted once, the process's age read from the kernel, and what /metrics
and `kvfleet bench startup` make of them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kvfleet.runtime import startup_phases
from kvfleet.runtime.bench.startup import StartupRun, format_startup_report, phases_from_metrics
from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.startup_phases import StartupPhases


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_phase_inside_another_is_counted_in_the_inner_one_only(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(startup_phases.time, "perf_counter", clock)
    phases = StartupPhases()
    with phases.phase("weights"):
        clock.now += 1.0
        with phases.phase("kernels"):
            clock.now += 4.0
        clock.now += 0.5
        with phases.phase("kernels"):
            clock.now += 2.0
    with phases.phase("kv_cache"):
        clock.now += 0.25
    assert phases.seconds == {"kernels": 6.0, "weights": 1.5, "kv_cache": 0.25}
    # The phases of one thread add up to the time they span.
    assert sum(phases.seconds.values()) == clock.now


def test_process_age_counts_from_the_process_start() -> None:
    """The child's age when it reads it is at most the time since the parent launched it (plus one clock tick,
    the kernel's resolution), and the interpreter's own start is part of it."""
    launched = time.clock_gettime(time.CLOCK_BOOTTIME)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; from kvfleet.runtime.startup_phases import process_age; "
            "print(process_age(), time.clock_gettime(time.CLOCK_BOOTTIME))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    age, read_at = map(float, child.stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0 < age <= read_at - launched + tick


def test_metrics_export_the_phases_that_the_bench_reads_back() -> None:
    metrics = ServerMetrics("m")
    assert phases_from_metrics(metrics.render().decode()) == {}  # nothing before the engine is ready
    phases = {"engine_core_imports": 1.25, "weights": 0.5}
    metrics.set_startup(3.5, lambda: phases)
    phases["api_server_bind"] = 0.125  # an API server phase that ends after the engine is ready
    text = metrics.render().decode()
    assert phases_from_metrics(text) == phases
    assert 'kvfleet:startup_seconds{model_name="m"} 3.5' in text.splitlines()


def test_the_report_gives_each_kind_its_median_and_range() -> None:
    runs = [
        StartupRun("cold", 30.0, 31.0, {"kernels": 20.0}),
        StartupRun("cold", 10.0, 12.0, {"kernels": 5.0}),
        StartupRun("cold", 20.0, 21.0, {"kernels": 9.0}),
        StartupRun("warm", 4.0, 4.5, {"kernels": 0.01, "weights": 0.2}),
    ]
    lines = format_startup_report(runs).splitlines()
    assert lines[0] == "| seconds | cold (median, range) | warm (median, range) |"
    assert "| kernels | 9.00 (5.00–20.00) | 0.01 (0.01–0.01) |" in lines
    assert "| weights | – | 0.20 (0.20–0.20) |" in lines
    assert "| **time to Ready** | 20.00 (10.00–30.00) | 4.00 (4.00–4.00) |" in lines
