"""Torch's thread count per step on the CPU: what the step can use, within what the CPUs give.

Every thread makes a compute-bound step faster. A small step is bound by memory bandwidth, and each of its
many parallel regions waits for its slowest thread: when an API server beside the engine takes a CPU for a
moment, that thread is descheduled and the whole step stalls. Measured on 2 CPUs with the API server beside
the core at 4 requests/s: decode steps took 13.5 ms on 2 threads against 11 ms on one. So small steps leave
the reserved CPUs to the front end, as vLLM's CPU backend does for good.

Other processes take CPUs too (a neighbour on the node): offline on 2 CPUs with a busy loop on one, two
threads lost up to 60% of the throughput (docs/benchmarks.md). So the count also follows the CPU time the
threads get. Every WINDOW_SECONDS of steps, the kernel's schedstat gives how long the process's threads were
runnable but waiting for a CPU: past CONTENDED_WAIT_SHARE of their runnable time, one thread fewer. A thread
taken away comes back once the CPUs this process may use sat idle for IDLE_CPUS_FOR_A_THREAD of a CPU over a
window.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# A CPU step of at least this many tokens is compute-bound (prefill chunks, large batches) and runs on every
# thread; a smaller one is bound by reading the weights and leaves the reserved CPUs to the front end.
PARALLEL_STEP_TOKENS = 16
WINDOW_SECONDS = 0.5
CONTENDED_WAIT_SHARE = 0.2
IDLE_CPUS_FOR_A_THREAD = 0.75
_PROC = Path("/proc")


@dataclass(frozen=True)
class CpuReading:
    """What the kernel counted up to a moment: nanoseconds the process's threads ran and waited runnable
    for a CPU, and seconds the CPUs this process may use were idle."""

    run_ns: int
    wait_ns: int
    idle_s: float


def read_cpus() -> CpuReading | None:
    """The reading now; None where the kernel keeps no schedstat (CONFIG_SCHED_INFO) or no /proc/stat."""
    run_ns = wait_ns = 0
    try:
        for task in (_PROC / "self" / "task").iterdir():
            try:
                run, wait, _ = (task / "schedstat").read_text().split()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            run_ns += int(run)
            wait_ns += int(wait)
        allowed = {f"cpu{cpu}" for cpu in os.sched_getaffinity(0)}
        idle_ticks = 0
        for line in (_PROC / "stat").read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in allowed:
                idle_ticks += int(fields[4]) + int(fields[5])  # idle and iowait
    except (OSError, ValueError):
        return None
    return CpuReading(run_ns, wait_ns, idle_ticks / os.sysconf("SC_CLK_TCK"))


class CpuThreads:
    def __init__(
        self,
        total: int,
        reserved: int,
        read: Callable[[], CpuReading | None] = read_cpus,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.small_step = max(1, total - reserved)
        # The most threads the CPUs give now (see the module's docstring).
        self.limit = total
        self._read = read
        self._clock = clock
        # The window's start, from the first step (not the model's load, which runs on one thread).
        self._since: tuple[float, CpuReading] | None = None

    def use_for(self, num_tokens: int) -> None:
        if self.total > 1:
            self._follow_the_cpus()
        wanted = self.total if num_tokens >= PARALLEL_STEP_TOKENS else self.small_step
        threads = min(wanted, self.limit)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _follow_the_cpus(self) -> None:
        now = self._clock()
        if self._since is not None and now - self._since[0] < WINDOW_SECONDS:
            return
        reading = self._read()
        if reading is None:
            return
        if self._since is not None:
            started, before = self._since
            run, wait = reading.run_ns - before.run_ns, reading.wait_ns - before.wait_ns
            if self.limit > 1 and wait > CONTENDED_WAIT_SHARE * (run + wait):
                self.limit -= 1
            elif self.limit < self.total and reading.idle_s - before.idle_s >= IDLE_CPUS_FOR_A_THREAD * (
                now - started
            ):
                self.limit += 1
        self._since = (now, reading)


def cpu_threads(reserved: int) -> CpuThreads:
    """Every CPU this process may run on (torch's default counts the physical cores of the whole machine,
    which over- or under-subscribes in containers), unless OMP_NUM_THREADS chose a count."""
    if "OMP_NUM_THREADS" in os.environ:
        total = torch.get_num_threads()
    elif hasattr(os, "sched_getaffinity"):
        total = len(os.sched_getaffinity(0))
    else:
        total = os.cpu_count() or 1
    torch.set_num_threads(total)
    return CpuThreads(total, reserved)
