"""The service loops' blocking API calls, run on a fixed set of threads, the most urgent first.

When a fleet is applied at once, hundreds of service loops call the API server together, and its
throughput decides how long each call waits. What users wait for is the Deployment (it creates the
pods); a Service, a budget or a status report can wait behind it. So the line is kept here rather than
in the server: at most `workers` calls are in flight, and a call starts only while no more urgent call
waits or runs. During a burst the server's whole share goes to Deployments; the rest follows them. A
call that hangs (a slow admission webhook) holds the others back for `hold_seconds` at the most.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

# How long a call in flight may keep less urgent ones waiting.
HOLD_SECONDS = 5.0


class Urgency(enum.IntEnum):
    DEPLOYMENT = 0
    CHILD = 1
    STATUS = 2


@dataclass(order=True)
class _Call:
    urgency: Urgency
    sequence: int
    function: Callable[[], Any] = field(compare=False)
    result: asyncio.Future[Any] = field(compare=False)


class PriorityDispatcher:
    def __init__(self, workers: int, hold_seconds: float = HOLD_SECONDS) -> None:
        self.workers = workers
        self.hold_seconds = hold_seconds
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube-api")
        self._waiting: list[_Call] = []
        self._sequence = itertools.count()
        # Kept as counts (not read off the queue) so that the metrics thread can read them at any time.
        self._waiting_count: Counter[Urgency] = Counter()
        self._running: Counter[Urgency] = Counter()
        self._started_at: dict[int, tuple[Urgency, float]] = {}  # by sequence number, the calls in flight
        self._recheck: asyncio.TimerHandle | None = None
        self._closed = False

    def waiting(self, urgency: Urgency) -> int:
        return self._waiting_count[urgency]

    def in_flight(self, urgency: Urgency) -> int:
        return self._running[urgency]

    async def call(self, urgency: Urgency, function: Callable[[], T]) -> T:
        """Runs `function` on a worker thread once no more urgent call waits or runs; returns its result."""
        if self._closed:
            raise RuntimeError("the API call dispatcher is closed (the operator is shutting down)")
        result: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, _Call(urgency, next(self._sequence), function, result))
        self._waiting_count[urgency] += 1
        self._start_next()
        return await result

    def close(self) -> None:
        """Cancels the waiting calls; those in flight finish, and nothing starts after them."""
        self._closed = True
        if self._recheck is not None:
            self._recheck.cancel()
        for waiting in self._waiting:
            waiting.result.cancel()
        self._waiting.clear()
        self._waiting_count.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start_next(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed and self._waiting and self._running.total() < self.workers:
            call = self._waiting[0]
            held_until = self._held_until(call.urgency, loop.time())
            if held_until is not None:
                if self._recheck is None or self._recheck.when() > held_until:
                    if self._recheck is not None:
                        self._recheck.cancel()
                    self._recheck = loop.call_at(held_until, self._recheck_now)
                return
            heapq.heappop(self._waiting)
            self._waiting_count[call.urgency] -= 1
            if call.result.cancelled():  # its caller stopped waiting (a loop shut down)
                continue
            self._running[call.urgency] += 1
            self._started_at[call.sequence] = call.urgency, loop.time()
            running = loop.run_in_executor(self._pool, call.function)
            running.add_done_callback(lambda done, call=call: self._finished(call, done))

    def _held_until(self, urgency: Urgency, now: float) -> float | None:
        """Until when more urgent calls in flight hold back one of `urgency`; None when nothing does."""
        holds = [
            started + self.hold_seconds
            for running, started in self._started_at.values()
            if running < urgency and now < started + self.hold_seconds
        ]
        return max(holds, default=None)

    def _recheck_now(self) -> None:
        self._recheck = None
        self._start_next()

    def _finished(self, call: _Call, done: asyncio.Future[Any]) -> None:
        self._running[call.urgency] -= 1
        del self._started_at[call.sequence]
        if not call.result.cancelled():
            if done.cancelled():
                call.result.cancel()
            elif (error := done.exception()) is not None:
                call.result.set_exception(error)
            else:
                call.result.set_result(done.result())
        self._start_next()
