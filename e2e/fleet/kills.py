"""Replicas killed with SIGKILL, as a crash would, at moments their own counters pick, from a process of its
own.

A test's streams are read by client threads in the test's process, one a stream. On a loaded machine those
threads hold the interpreter lock so much of the time that a read of the replicas' counters from the same
process waited seconds (4.3 s in one run with 60 streams), while the replicas generate a run's tokens in a
few: the moment a kill was meant for had passed, or the streams had ended, before the read came back. A
child process reads them without that wait.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import TracebackType

from e2e.fleet.gateway import metric_in, scrape
from e2e.fleet.traffic import Endpoint

GENERATED = "kvfleet:generation_tokens_total"
RUNNING = "kvfleet:num_requests_running"
WAITING = "kvfleet:num_requests_waiting"
# Between two reads of the counters; a read itself took 0.1 to 0.6 s on a loaded machine, once 2.3 s.
POLL_SECONDS = 0.02
# How long the child may take to start and read the counters once.
START_SECONDS = 60.0
READY = "ready"
STREAMS_ENDED = "streams ended"


@dataclass(frozen=True)
class Kill:
    victim: str
    # time.monotonic() of the kill: the system's monotonic clock, the same in every process.
    at: float
    # Tokens the replicas had generated since the child started, and requests the victim held (running or
    # waiting), as the read before the kill saw them.
    generated: float
    held: float


class ReplicaKiller:
    """Around a run of streams: kills a random replica among those holding requests once the replicas have
    generated each of `thresholds` tokens since it was entered (a replica the routing left idle would cut
    nothing). `pids`: each replica's runtime process."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        pids: dict[str, int],
        thresholds: list[float],
        rng: random.Random,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(
            target=_kill_at_thresholds,
            args=(child_end, endpoints, pids, sorted(thresholds), rng),
            name="replica-killer",
            daemon=True,
        )
        self._child_end = child_end

    def __enter__(self) -> ReplicaKiller:
        self._process.start()
        self._child_end.close()
        assert self._receive(START_SECONDS) == READY
        return self

    def kills(self, timeout: float) -> list[Kill]:
        """Once the streams have ended: the kills, or a failure where the streams ended before them."""
        self._connection.send(STREAMS_ENDED)
        result = self._receive(timeout)
        if isinstance(result, str):
            raise AssertionError(result)
        return result

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._connection.close()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _receive(self, timeout: float) -> object:
        if not self._connection.poll(timeout):
            raise AssertionError(f"the replica killer said nothing within {timeout:.0f}s")
        try:
            return self._connection.recv()
        except EOFError:
            raise AssertionError(f"the replica killer exited with {self._process.exitcode}") from None


def _kill_at_thresholds(
    connection: Connection,
    endpoints: list[Endpoint],
    pids: dict[str, int],
    thresholds: list[float],
    rng: random.Random,
) -> None:
    """The child: the kills, sent once the parent says the streams ended; or why none could be made."""
    generated: dict[str, float] = {}
    holding: dict[str, float] = {}
    killed: set[str] = set()

    def read(pool: ThreadPoolExecutor) -> None:
        # Every replica at once: one slow scrape delays the others' by no more than itself.
        alive = [endpoint for endpoint in endpoints if endpoint.pod not in killed]
        for endpoint, text in zip(alive, pool.map(scrape, alive), strict=True):
            generated[endpoint.pod] = metric_in(text, GENERATED)
            holding[endpoint.pod] = metric_in(text, RUNNING) + metric_in(text, WAITING)

    kills = []
    with ThreadPoolExecutor(len(endpoints)) as pool:
        read(pool)
        before = sum(generated.values())
        connection.send(READY)
        for tokens in thresholds:
            while True:
                read(pool)
                held = sorted(pod for pod, count in holding.items() if count and pod not in killed)
                if held and sum(generated.values()) - before >= tokens:
                    break
                if connection.poll(POLL_SECONDS):
                    if _parent_gone(connection):
                        return
                    connection.send(
                        f"the streams ended before the replicas had generated {tokens:.0f} tokens with a "
                        f"request held ({len(kills)} killed before)"
                    )
                    return
            victim = rng.choice(held)
            os.kill(pids[victim], signal.SIGKILL)
            killed.add(victim)
            kills.append(Kill(victim, time.monotonic(), sum(generated.values()) - before, holding[victim]))
    if not _parent_gone(connection):
        connection.send(kills)


def _parent_gone(connection: Connection) -> bool:
    """Waits for the parent's word that the streams ended: False once it comes, True where the parent closed
    its end instead (its test failed before the streams ended)."""
    try:
        return connection.recv() != STREAMS_ENDED
    except EOFError:
        return True
