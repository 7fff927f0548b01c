"""Where a replica's start goes: each phase of it timed once, in the process it runs in.

A process keeps its phases in `STARTUP_PHASES`. A phase that runs inside another on the same thread (a kernel
build inside the weight load, say) is counted in the inner one only, so one thread's phases add up to the time
they span; a phase on another thread (the tokenizer's load) overlaps them. The
EngineCore logs its phases once it is ready and sends them with its Ready answer; the API server logs its own
and the time to Ready once the engine is ready, and exports both on /metrics (metrics.py).

The two processes' phases overlap (the EngineCore loads the model while the API server imports and binds), so
together they add up to more than the time to Ready, which is measured apart from them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator


class StartupPhases:
    """Seconds by phase name, in the order the phases first ended."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._thread = threading.local()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as `name` (adding to it if it ran before), less the phases timed inside it."""
        # For each phase this thread runs now, outermost first: the seconds its inner phases took.
        running: list[float] = self._thread.__dict__.setdefault("running", [])
        start = time.perf_counter()
        running.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = running.pop()
            if running:
                running[-1] += elapsed
            self.add(name, elapsed - inner)

    def add(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (before the process could time it, or on another thread)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())


# This process's.
STARTUP_PHASES = StartupPhases()


def process_age() -> float:
    """Seconds since this process was started (exec'd, before the interpreter itself started), from the
    kernel's record of it: the time an interpreter and its imports take before any code could time them."""
    with open("/proc/self/stat") as stat:
        # The fields after the command name, which is in parentheses and may hold spaces; starttime is the
        # 22nd field, in clock ticks since boot.
        fields = stat.read().rpartition(")")[2].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started
