"""SLA tiers under overload: with the queue full of `batch` requests, a `critical` one is served next under
the priority policy (shedding a queued `batch` request if the queue is at its limit), while FCFS makes it
wait behind the whole queue.

Robust on slow and fast machines alike: one batch request holds the only sequence slot for as long as the
context allows, the test fills the queue behind it, sends the critical request, then frees the slot by
disconnecting the long request. The assertions compare orders, and waits counted in decode steps (the pace
of the long request), never absolute times. How much faster critical requests are served is measured by
`kvfleet bench serve` (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from servers import ServerProcess

MAX_NUM_SEQS = 1
WAITING_LIMIT = 6
# All the tiny model's context allows: it cannot finish on its own while the test sets up the queue.
HOLDING_TOKENS = 2000
QUEUED_TOKENS = 40
# Once the slot frees, the critical request starts at once under priority (a step or two), but only after
# every queued request under FCFS: WAITING_LIMIT * QUEUED_TOKENS = 240 steps. Wide margins on both sides.
PRIORITY_MAX_WAIT_STEPS = 20
FCFS_MIN_WAIT_STEPS = QUEUED_TOKENS


@dataclass
class Outcome:
    status: int = 0
    error_code: str | None = None
    retry_after: str | None = None
    # Arrival times of the chunks that carried text.
    chunks: list[float] = field(default_factory=list)

    @property
    def first_token(self) -> float | None:
        return self.chunks[0] if self.chunks else None


async def _stream(client: httpx.AsyncClient, body: dict, headers: dict[str, str], outcome: Outcome) -> None:
    request = {"model": "tiny", "prompt": "bulk", "ignore_eos": True, "stream": True, **body}
    async with client.stream("POST", "/v1/completions", json=request, headers=headers) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            outcome.error_code = response.json()["error"]["code"]
            outcome.retry_after = response.headers.get("retry-after")
            return
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[len("data: ") :])["choices"][0]["text"]:
                outcome.chunks.append(time.monotonic())


async def _wait_for(server: ServerProcess, running: int, waiting: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(server.metrics)
        counts = metrics["kvfleet:num_requests_running"], metrics["kvfleet:num_requests_waiting"]
        if counts == (running, waiting):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"the server never had {running} running and {waiting} waiting requests")


@dataclass
class Overload:
    critical: Outcome
    queued: list[Outcome]
    extra: Outcome
    # In decode steps of the holding request: from freeing the slot to the critical request's first token.
    critical_wait_steps: float


async def _overload(server: ServerProcess, *, limited_queue: bool, tier: str) -> Overload:
    tier_header = {"x-kvfleet-priority": tier}
    holding, critical, extra = Outcome(), Outcome(), Outcome()
    queued = [Outcome() for _ in range(WAITING_LIMIT)]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        holder = asyncio.create_task(_stream(client, {"max_tokens": HOLDING_TOKENS}, tier_header, holding))
        await _wait_for(server, running=1, waiting=0)
        short = {"max_tokens": QUEUED_TOKENS}
        tasks = [asyncio.create_task(_stream(client, short, tier_header, outcome)) for outcome in queued]
        await _wait_for(server, running=1, waiting=WAITING_LIMIT)
        if limited_queue:
            # Refused at once: the queue is at its limit and nothing queued is below the batch tier.
            await _stream(client, short, tier_header, extra)
        urgent = asyncio.create_task(_stream(client, {"max_tokens": 4, "priority": "critical"}, {}, critical))
        if limited_queue:
            # Admitted by shedding a queued batch request: the queue stays at its limit.
            await _until(lambda: any(o.status == 429 for o in queued))
        else:
            await _wait_for(server, running=1, waiting=WAITING_LIMIT + 1)
        assert holding.status == 200 and len(holding.chunks) > 1, "the holding request ended too early"
        step = (holding.chunks[-1] - holding.chunks[0]) / (len(holding.chunks) - 1)
        freed = time.monotonic()
        holder.cancel()
        await urgent
        for task in tasks:
            task.cancel()
        await asyncio.gather(holder, *tasks, return_exceptions=True)
    assert critical.first_token is not None
    return Overload(critical, queued, extra, (critical.first_token - freed) / step)


async def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def priority_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    policy = ("--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS))
    return start_server(*policy, "--max-waiting-requests", str(WAITING_LIMIT))


@pytest.fixture(scope="module")
def fcfs_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server("--scheduling-policy", "fcfs", "--max-num-seqs", str(MAX_NUM_SEQS))


def test_critical_overtakes_the_queue_under_priority(priority_server: ServerProcess) -> None:
    run = asyncio.run(_overload(priority_server, limited_queue=True, tier="batch"))
    # The queue was full: another batch request is refused outright, with a hint when to come back.
    assert run.extra.status == 429 and run.extra.error_code == "overloaded" and run.extra.retry_after
    # The critical request got in by shedding one queued batch request (lowest tier first)...
    assert run.critical.status == 200
    shed = [outcome for outcome in run.queued if outcome.status == 429]
    assert len(shed) == 1 and shed[0].error_code == "shed" and shed[0].retry_after is not None
    # ...starts as soon as the slot frees, before every batch request queued ahead of it.
    served = [outcome for outcome in run.queued if outcome.status == 200]
    assert all(o.first_token is None or o.first_token > run.critical.first_token for o in served)
    assert run.critical_wait_steps < PRIORITY_MAX_WAIT_STEPS


def test_critical_waits_behind_the_queue_under_fcfs(fcfs_server: ServerProcess) -> None:
    # Standard requests: the batch tier would step aside for the critical one under either policy.
    run = asyncio.run(_overload(fcfs_server, limited_queue=False, tier="standard"))
    assert run.critical.status == 200
    # Every request queued before it starts first, so it waits for their tokens too.
    assert all(o.status == 200 and o.first_token is not None for o in run.queued)
    assert all(o.first_token < run.critical.first_token for o in run.queued)  # type: ignore[operator]
    assert run.critical_wait_steps > FCFS_MIN_WAIT_STEPS
