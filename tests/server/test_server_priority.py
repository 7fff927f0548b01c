"""SLA tiers under overload: with the queue full of `batch` requests, a `critical` one is served next under
the priority policy (shedding a queued `batch` request if the queue is at its limit), while FCFS makes it
wait behind the whole queue.

Robust on a slow shared machine: the assertions compare orders and ratios measured in the same run, not
absolute times.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import ServerProcess

MAX_NUM_SEQS = 1
WAITING_LIMIT = 6
# The running request is long enough that the test fills the queue behind it; FCFS then makes the critical
# request wait for all the queued ones as well, several times longer than for the running one alone.
RUNNING_TOKENS = 120
QUEUED_TOKENS = 40


@dataclass
class Outcome:
    status: int = 0
    submitted: float = 0.0
    first_token: float | None = None
    error_code: str | None = None
    retry_after: str | None = None


async def _stream(client: httpx.AsyncClient, body: dict, headers: dict[str, str], outcome: Outcome) -> None:
    outcome.submitted = time.monotonic()
    async with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            outcome.error_code = response.json()["error"]["code"]
            outcome.retry_after = response.headers.get("retry-after")
            return
        async for line in response.aiter_lines():
            is_chunk = outcome.first_token is None and line.startswith("data: {")
            if is_chunk and json.loads(line[len("data: ") :])["choices"][0]["text"]:
                outcome.first_token = time.monotonic()


async def _wait_for(server: ServerProcess, running: int, waiting: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(server.metrics)
        if (metrics["kvfleet:num_requests_running"], metrics["kvfleet:num_requests_waiting"]) == (
            running,
            waiting,
        ):
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"the server never had {running} running and {waiting} waiting requests")


async def _overload(server: ServerProcess, *, extra_batch: bool) -> tuple[Outcome, list[Outcome], Outcome]:
    """One batch request running, WAITING_LIMIT queued behind it, then a critical one.

    Returns (critical, queued batch, extra batch sent when the queue was full, if asked for). The batch
    requests still going when the critical one is done are then dropped: nothing more is measured.
    """

    def body(tokens: int) -> dict:
        return {"model": "tiny", "prompt": "bulk", "max_tokens": tokens, "ignore_eos": True}

    batch = {"x-kvfleet-priority": "batch"}
    critical, extra, queued = Outcome(), Outcome(), [Outcome() for _ in range(WAITING_LIMIT)]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        tasks = [asyncio.create_task(_stream(client, body(RUNNING_TOKENS), batch, Outcome()))]
        await _wait_for(server, running=1, waiting=0)
        tasks += [asyncio.create_task(_stream(client, body(QUEUED_TOKENS), batch, o)) for o in queued]
        await _wait_for(server, running=1, waiting=WAITING_LIMIT)
        if extra_batch:
            await _stream(client, body(QUEUED_TOKENS), batch, extra)
        await _stream(client, {**body(4), "priority": "critical"}, {}, critical)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return critical, queued, extra


@pytest.fixture(scope="module")
def priority_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    policy = ("--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS))
    return start_server(*policy, "--max-waiting-requests", str(WAITING_LIMIT))


@pytest.fixture(scope="module")
def fcfs_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server("--scheduling-policy", "fcfs", "--max-num-seqs", str(MAX_NUM_SEQS))


def test_critical_overtakes_the_queue_under_priority_but_not_fcfs(
    priority_server: ServerProcess, fcfs_server: ServerProcess
) -> None:
    critical, queued, extra = asyncio.run(_overload(priority_server, extra_batch=True))
    # The queue was full: another batch request is refused outright, with a hint when to come back.
    assert extra.status == 429 and extra.error_code == "overloaded" and extra.retry_after is not None
    # The critical request gets in by shedding one queued batch request (lowest tier first)...
    assert critical.status == 200 and critical.first_token is not None
    shed = [outcome for outcome in queued if outcome.status == 429]
    assert len(shed) == 1 and shed[0].error_code == "shed" and shed[0].retry_after is not None
    # ...and is served before every batch request queued ahead of it.
    assert all(
        o.first_token is None or o.first_token > critical.first_token for o in queued if o.status == 200
    )
    priority_ttft = critical.first_token - critical.submitted

    critical, queued, _ = asyncio.run(_overload(fcfs_server, extra_batch=False))
    assert critical.status == 200 and critical.first_token is not None
    # FCFS: every request queued before it starts first.
    assert all(o.status == 200 and o.first_token is not None for o in queued)
    assert all(o.first_token < critical.first_token for o in queued)
    fcfs_ttft = critical.first_token - critical.submitted

    assert priority_ttft < 0.5 * fcfs_ttft, (priority_ttft, fcfs_ttft)
