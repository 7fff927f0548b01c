"""The CPU thread count: one thread fewer when the threads wait for CPUs, one back when a CPU sits idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from kvfleet.runtime.worker.cpu_threads import CpuReading, CpuThreads, read_cpus

LARGE_STEP, SMALL_STEP = 64, 1


class FakeCpus:
    """Readings and a clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reading: CpuReading | None = CpuReading(0, 0, 0.0)

    def window(self, seconds: float, run_s: float, wait_s: float, idle_s: float) -> None:
        assert self.reading is not None
        before = self.reading
        self.now += seconds
        self.reading = CpuReading(
            before.run_ns + int(run_s * 1e9), before.wait_ns + int(wait_s * 1e9), before.idle_s + idle_s
        )


@pytest.fixture
def cpus() -> Iterator[FakeCpus]:
    threads_before = torch.get_num_threads()
    try:
        yield FakeCpus()
    finally:
        torch.set_num_threads(threads_before)


def _step_after(
    policy: CpuThreads,
    cpus: FakeCpus,
    seconds: float,
    run_s: float,
    wait_s: float,
    idle_s: float,
    tokens: int,
) -> tuple[int, int]:
    """The limit and torch's thread count for a step of `tokens` after a window of those readings."""
    cpus.window(seconds, run_s, wait_s, idle_s)
    policy.use_for(tokens)
    return policy.limit, torch.get_num_threads()


def _policy(cpus: FakeCpus, total: int = 2, reserved: int = 0) -> CpuThreads:
    policy = CpuThreads(total, reserved, read=lambda: cpus.reading, clock=lambda: cpus.now)
    policy.use_for(LARGE_STEP)  # the first step starts the first window
    return policy


def test_threads_that_wait_a_fifth_of_their_time_for_a_cpu_lose_one(cpus: FakeCpus) -> None:
    policy = _policy(cpus, total=4)
    assert torch.get_num_threads() == 4
    # 1 s of two threads running, 0.3 s runnable but waiting: 23% of 1.3 s.
    assert _step_after(policy, cpus, 0.5, run_s=1.0, wait_s=0.3, idle_s=0.0, tokens=LARGE_STEP) == (3, 3)
    # 0.25 of 1.25 s is 20%: not past it.
    assert _step_after(policy, cpus, 0.5, run_s=1.0, wait_s=0.25, idle_s=0.0, tokens=LARGE_STEP) == (3, 3)


def test_a_thread_comes_back_when_a_cpu_sat_idle_three_quarters_of_the_window(cpus: FakeCpus) -> None:
    policy = _policy(cpus)
    assert _step_after(policy, cpus, 0.5, run_s=0.6, wait_s=0.4, idle_s=0.0, tokens=LARGE_STEP)[0] == 1
    # 0.3 s idle over a 0.5 s window: 0.6 of a CPU.
    assert _step_after(policy, cpus, 0.5, run_s=0.5, wait_s=0.0, idle_s=0.3, tokens=LARGE_STEP) == (1, 1)
    # 0.4 s of 0.5: 0.8 of a CPU.
    assert _step_after(policy, cpus, 0.5, run_s=0.5, wait_s=0.0, idle_s=0.4, tokens=LARGE_STEP) == (2, 2)
    # Never past the total, however idle.
    assert _step_after(policy, cpus, 0.5, run_s=0.5, wait_s=0.0, idle_s=1.0, tokens=LARGE_STEP)[0] == 2


def test_readings_are_taken_once_a_window_and_the_limit_caps_small_steps_too(cpus: FakeCpus) -> None:
    policy = _policy(cpus, total=4, reserved=1)
    policy.use_for(SMALL_STEP)
    assert torch.get_num_threads() == 3  # the reserved CPU left to the front end
    # 0.4 s: the window is not over.
    assert _step_after(policy, cpus, 0.4, run_s=1.0, wait_s=1.0, idle_s=0.0, tokens=LARGE_STEP) == (4, 4)
    assert _step_after(policy, cpus, 0.1, run_s=0.0, wait_s=0.0, idle_s=0.0, tokens=SMALL_STEP) == (3, 3)
    assert _step_after(policy, cpus, 0.5, run_s=1.0, wait_s=1.0, idle_s=0.0, tokens=SMALL_STEP) == (2, 2)


def test_without_the_kernels_counts_the_threads_stay_as_the_step_wants(cpus: FakeCpus) -> None:
    cpus.reading = None
    policy = _policy(cpus)
    cpus.now += 5.0
    policy.use_for(LARGE_STEP)
    assert (policy.limit, torch.get_num_threads()) == (2, 2)


def test_the_kernels_counts_follow_this_process() -> None:
    before, started = read_cpus(), time.thread_time()
    while time.thread_time() - started < 0.2:  # 0.2 s on a CPU, however busy the machine
        pass
    after = read_cpus()
    assert before is not None and after is not None
    assert after.run_ns - before.run_ns >= 0.19e9
    assert after.wait_ns >= before.wait_ns and after.idle_s >= before.idle_s


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"GOMP_SPINCOUNT": "30000"}),  # workers spin through a step's gaps, a bounded time
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
        ({"GOMP_SPINCOUNT": "500"}, {"GOMP_SPINCOUNT": "500"}),
    ],
)
def test_openmp_wait_policy_defaults_to_a_bounded_spin(given: dict[str, str], expected: dict) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | given
    script = "import json, os, kvfleet.runtime; print(json.dumps({n: os.environ.get(n) for n in %r}))"
    seen = subprocess.run(
        [sys.executable, "-c", script % list(expected)], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(seen.stdout) == expected
