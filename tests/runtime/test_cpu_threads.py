"""The CPU thread count: one thread fewer when the threads wait for CPUs, one back when a CPU sits idle."""

from __future__ import annotations

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


def _policy(cpus: FakeCpus, total: int = 2, reserved: int = 0) -> CpuThreads:
    policy = CpuThreads(total, reserved, read=lambda: cpus.reading, clock=lambda: cpus.now)
    policy.use_for(LARGE_STEP)  # the first step starts the first window
    return policy


def test_threads_that_wait_a_fifth_of_their_time_for_a_cpu_lose_one(cpus: FakeCpus) -> None:
    policy = _policy(cpus, total=4)
    assert torch.get_num_threads() == 4
    # 1 s of two threads running, 0.3 s runnable but waiting: 23% of 1.3 s.
    cpus.window(0.5, run_s=1.0, wait_s=0.3, idle_s=0.0)
    policy.use_for(LARGE_STEP)
    assert (policy.limit, torch.get_num_threads()) == (3, 3)
    # 0.25 of 1.25 s is 20%: not past it.
    cpus.window(0.5, run_s=1.0, wait_s=0.25, idle_s=0.0)
    policy.use_for(LARGE_STEP)
    assert (policy.limit, torch.get_num_threads()) == (3, 3)


def test_a_thread_comes_back_when_a_cpu_sat_idle_three_quarters_of_the_window(cpus: FakeCpus) -> None:
    policy = _policy(cpus)
    cpus.window(0.5, run_s=0.6, wait_s=0.4, idle_s=0.0)
    policy.use_for(LARGE_STEP)
    assert policy.limit == 1
    # 0.3 s idle over a 0.5 s window: 0.6 of a CPU.
    cpus.window(0.5, run_s=0.5, wait_s=0.0, idle_s=0.3)
    policy.use_for(LARGE_STEP)
    assert (policy.limit, torch.get_num_threads()) == (1, 1)
    # 0.4 s of 0.5: 0.8 of a CPU.
    cpus.window(0.5, run_s=0.5, wait_s=0.0, idle_s=0.4)
    policy.use_for(LARGE_STEP)
    assert (policy.limit, torch.get_num_threads()) == (2, 2)
    # Never past the total, however idle.
    cpus.window(0.5, run_s=0.5, wait_s=0.0, idle_s=1.0)
    policy.use_for(LARGE_STEP)
    assert policy.limit == 2


def test_readings_are_taken_once_a_window_and_the_limit_caps_small_steps_too(cpus: FakeCpus) -> None:
    policy = _policy(cpus, total=4, reserved=1)
    policy.use_for(SMALL_STEP)
    assert torch.get_num_threads() == 3  # the reserved CPU left to the front end
    cpus.window(0.4, run_s=1.0, wait_s=1.0, idle_s=0.0)
    policy.use_for(LARGE_STEP)
    assert policy.limit == 4  # 0.4 s: the window is not over
    cpus.window(0.1, run_s=0.0, wait_s=0.0, idle_s=0.0)
    policy.use_for(SMALL_STEP)
    assert (policy.limit, torch.get_num_threads()) == (3, 3)
    cpus.window(0.5, run_s=1.0, wait_s=1.0, idle_s=0.0)
    policy.use_for(SMALL_STEP)
    assert (policy.limit, torch.get_num_threads()) == (2, 2)


def test_without_the_kernels_counts_the_threads_stay_as_the_step_wants(cpus: FakeCpus) -> None:
    cpus.reading = None
    policy = _policy(cpus)
    cpus.now += 5.0
    policy.use_for(LARGE_STEP)
    assert (policy.limit, torch.get_num_threads()) == (2, 2)


def test_the_kernels_counts_follow_this_process_and_the_clock() -> None:
    before, started = read_cpus(), time.monotonic()
    while time.monotonic() - started < 0.2:
        pass
    after = read_cpus()
    assert before is not None and after is not None
    assert after.run_ns - before.run_ns >= 0.15e9  # the loop ran about 0.2 s
    assert after.wait_ns >= before.wait_ns and after.idle_s >= before.idle_s
