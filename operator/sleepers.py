"""Replicas kept asleep (spec.scaling.sleepingReplicas) beside those the autoscaler wants awake.

The workload runs max(wanted, sleepingReplicas) replicas (ScalingSpec.started). Those beyond the wanted count
are put to sleep through the runtime's sleep mode (POST /sleep: the KV cache freed, the weights kept in host
memory) instead of being deleted, and woken (POST /wake_up) when more are wanted: a wake-up takes about a
second where a new replica loads its model for a minute or more.

A ready replica is awake: the runtime answers /ready with 503 while it sleeps. A started replica that is not
ready is asked GET /is_sleeping, so that the replicas alone hold the state and an operator that restarts
finds it as it was. Each pass wakes sleepers while fewer replicas are awake than wanted, and puts awake ones
to sleep while more are: only idle ones (nothing running or waiting in their latest report), and only while
the gateway holds no request for the service, so that a replica woken for a held request is not put back to
sleep before the request reaches it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from kvfleet.operator.adapters import ReplicaUnavailable
from kvfleet.operator.api import HTTP_PORT
from kvfleet.operator.autoscaler import PodMetrics
from kvfleet.operator.observed import PodView
from kvfleet.operator.scrape import ScrapeTarget, read_capped

# /is_sleeping answers a few bytes; anything longer is not the runtime.
_MAX_ANSWER_BYTES = 4096
# Mode wait: a request that reached the replica after its latest report finishes before it sleeps.
SLEEP_PATH = "/sleep?level=1&mode=wait"


class ReplicaSleep(Protocol):
    async def is_sleeping(self, target: ScrapeTarget, api_key: str | None) -> bool: ...

    async def sleep(self, target: ScrapeTarget, api_key: str | None) -> None: ...

    async def wake_up(self, target: ScrapeTarget, api_key: str | None) -> None: ...


class RuntimeSleepClient:
    """ReplicaSleep over the runtime's HTTP API; every failure is a ReplicaUnavailable."""

    def __init__(self, session: aiohttp.ClientSession, timeout_seconds: float = 60.0) -> None:
        self._session = session
        # A sleep waits for the requests in flight; a wake-up allocates the KV cache again.
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def is_sleeping(self, target: ScrapeTarget, api_key: str | None) -> bool:
        answer = await self._call("GET", target, "/is_sleeping", api_key)
        try:
            return json.loads(answer)["is_sleeping"] is True
        except (ValueError, KeyError, TypeError) as error:
            raise ReplicaUnavailable(f"{target.pod}: /is_sleeping answered what no runtime would") from error

    async def sleep(self, target: ScrapeTarget, api_key: str | None) -> None:
        await self._call("POST", target, SLEEP_PATH, api_key)

    async def wake_up(self, target: ScrapeTarget, api_key: str | None) -> None:
        await self._call("POST", target, "/wake_up", api_key)

    async def _call(self, method: str, target: ScrapeTarget, path: str, api_key: str | None) -> bytes:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            async with self._session.request(
                method, f"{target.base_url}{path}", headers=headers, timeout=self._timeout
            ) as response:
                answer = await read_capped(response, _MAX_ANSWER_BYTES)
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ReplicaUnavailable(f"{target.pod}: {path} did not answer: {error}") from error
        if status != 200 or answer is None:
            raise ReplicaUnavailable(f"{target.pod}: {path} answered HTTP {status}")
        return answer


@dataclass(frozen=True)
class SleepPlan:
    wake: tuple[PodView, ...] = ()
    sleep: tuple[PodView, ...] = ()


def plan(
    wanted: int,
    awake: Sequence[PodView],
    asleep: Sequence[PodView],
    reports: Mapping[PodView, PodMetrics | None],
    held: float | None,
) -> SleepPlan:
    """Which sleepers to wake and which awake replicas to put to sleep for `wanted` awake."""
    if len(awake) < wanted:
        return SleepPlan(wake=tuple(asleep[: wanted - len(awake)]))
    if len(awake) > wanted and held == 0:
        idle = [pod for pod in awake if (report := reports.get(pod)) is not None and report.queue_depth == 0]
        return SleepPlan(sleep=tuple(idle[: len(awake) - wanted]))
    return SleepPlan()


@dataclass(frozen=True)
class SleepPass:
    """What one pass did: the pods woken, those put to sleep, and the calls that failed (tried again on the
    next pass)."""

    woken: tuple[str, ...] = ()
    slept: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass
class Sleepers:
    client: ReplicaSleep

    async def keep(
        self,
        wanted: int,
        pods: Sequence[PodView],
        reports: Mapping[PodView, PodMetrics | None],
        held: float | None,
        api_key: str | None,
    ) -> SleepPass:
        awake = [pod for pod in pods if pod.scrapeable]
        started = [pod for pod in pods if not pod.ready and not pod.terminating and pod.ip is not None]
        answers = await asyncio.gather(
            *(self.client.is_sleeping(_target(pod), api_key) for pod in started), return_exceptions=True
        )
        asleep = [pod for pod, answer in zip(started, answers, strict=True) if answer is True]
        chosen = plan(wanted, awake, asleep, reports, held)
        woken = await _each(chosen.wake, self.client.wake_up, api_key)
        slept = await _each(chosen.sleep, self.client.sleep, api_key)
        return SleepPass(
            tuple(pod.name for pod, problem in zip(chosen.wake, woken, strict=True) if problem is None),
            tuple(pod.name for pod, problem in zip(chosen.sleep, slept, strict=True) if problem is None),
            tuple(problem for problem in (*woken, *slept) if problem is not None),
        )


async def _each(
    pods: Sequence[PodView], call: Callable[[ScrapeTarget, str | None], Awaitable[None]], api_key: str | None
) -> list[str | None]:
    """Calls every pod at once; for each, why the call failed, or None."""

    async def one(pod: PodView) -> str | None:
        try:
            await call(_target(pod), api_key)
        except ReplicaUnavailable as error:
            return str(error)
        return None

    return list(await asyncio.gather(*(one(pod) for pod in pods)))


def _target(pod: PodView) -> ScrapeTarget:
    assert pod.ip is not None
    return ScrapeTarget(pod.name, pod.ip, HTTP_PORT)
