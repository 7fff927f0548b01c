"""The API call dispatcher: urgency before arrival, bounded concurrency, errors, cancellation, metrics."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from kvfleet.operator.dispatch import PriorityDispatcher, Urgency
from kvfleet.operator.metrics import OperatorMetrics


@pytest.fixture
def dispatcher() -> Iterator[PriorityDispatcher]:
    dispatcher = PriorityDispatcher(workers=1)
    yield dispatcher
    dispatcher.close()


async def _occupy(dispatcher: PriorityDispatcher) -> tuple[asyncio.Task[None], threading.Event]:
    """A call that holds the only worker until the returned event is set."""
    release = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(timeout=10)

    task = asyncio.create_task(dispatcher.call(Urgency.STATUS, hold))
    while not started.is_set():
        await asyncio.sleep(0.001)
    return task, release


def test_urgent_calls_overtake_waiting_ones_and_equal_ones_keep_their_order(
    dispatcher: PriorityDispatcher,
) -> None:
    metrics = OperatorMetrics()
    metrics.watch_dispatcher(dispatcher)

    def exported(name: str, urgency: str) -> float | None:
        return metrics.registry.get_sample_value(f"kvfleet_operator_api_calls_{name}", {"urgency": urgency})

    async def scenario() -> list[str]:
        order: list[str] = []
        holder, release = await _occupy(dispatcher)
        queued = [
            ("status-1", Urgency.STATUS),
            ("service-1", Urgency.CHILD),
            ("deployment-1", Urgency.DEPLOYMENT),
            ("status-2", Urgency.STATUS),
            ("deployment-2", Urgency.DEPLOYMENT),
        ]
        tasks = [
            asyncio.create_task(dispatcher.call(urgency, lambda name=name: order.append(name)))
            for name, urgency in queued
        ]
        await asyncio.sleep(0.01)
        assert order == [], "one worker, held: everything waits"
        assert [dispatcher.waiting(urgency) for urgency in Urgency] == [2, 1, 2]
        assert [dispatcher.in_flight(urgency) for urgency in Urgency] == [0, 0, 1]
        assert exported("waiting", "deployment") == 2 and exported("in_flight", "status") == 1
        release.set()
        await asyncio.gather(holder, *tasks)
        assert exported("waiting", "status") == 0 and exported("in_flight", "status") == 0
        return order

    assert asyncio.run(scenario()) == ["deployment-1", "deployment-2", "service-1", "status-1", "status-2"]


def test_never_more_calls_in_flight_than_workers() -> None:
    dispatcher = PriorityDispatcher(workers=3)
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def work() -> int:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        threading.Event().wait(0.005)
        with lock:
            in_flight -= 1
        return 7

    async def scenario() -> list[int]:
        return await asyncio.gather(*(dispatcher.call(Urgency.CHILD, work) for _ in range(30)))

    try:
        assert asyncio.run(scenario()) == [7] * 30
    finally:
        dispatcher.close()
    assert peak == 3


def test_an_error_reaches_its_caller_and_the_next_call_still_runs(dispatcher: PriorityDispatcher) -> None:
    def refuse() -> None:
        raise ValueError("refused")

    async def scenario() -> str:
        with pytest.raises(ValueError, match="refused"):
            await dispatcher.call(Urgency.DEPLOYMENT, refuse)
        return await dispatcher.call(Urgency.DEPLOYMENT, lambda: "served")

    assert asyncio.run(scenario()) == "served"


def test_a_call_whose_caller_gave_up_while_waiting_never_runs(dispatcher: PriorityDispatcher) -> None:
    ran: list[str] = []

    async def scenario() -> None:
        holder, release = await _occupy(dispatcher)
        abandoned = asyncio.create_task(dispatcher.call(Urgency.DEPLOYMENT, lambda: ran.append("abandoned")))
        kept = asyncio.create_task(dispatcher.call(Urgency.STATUS, lambda: ran.append("kept")))
        await asyncio.sleep(0.01)
        abandoned.cancel()
        release.set()
        await asyncio.gather(holder, kept)
        with pytest.raises(asyncio.CancelledError):
            await abandoned

    asyncio.run(scenario())
    assert ran == ["kept"]


def test_close_cancels_waiting_calls_lets_running_ones_finish_and_refuses_new_ones() -> None:
    dispatcher = PriorityDispatcher(workers=1)
    ran: list[str] = []

    async def scenario() -> None:
        holder, release = await _occupy(dispatcher)
        waiting = asyncio.create_task(dispatcher.call(Urgency.DEPLOYMENT, lambda: ran.append("waiting")))
        await asyncio.sleep(0.01)
        dispatcher.close()
        release.set()
        await holder
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(RuntimeError, match="closed"):
            await dispatcher.call(Urgency.STATUS, lambda: ran.append("late"))

    asyncio.run(scenario())
    assert ran == []


def test_a_running_call_holds_less_urgent_ones_with_workers_free_for_the_hold_time_at_most() -> None:
    dispatcher = PriorityDispatcher(workers=4, hold_seconds=0.3)
    ran: list[str] = []

    async def scenario() -> None:
        release = threading.Event()
        hanging = asyncio.create_task(
            dispatcher.call(Urgency.DEPLOYMENT, lambda: (release.wait(timeout=10), ran.append("deployment")))
        )
        await asyncio.sleep(0.01)
        status = asyncio.create_task(dispatcher.call(Urgency.STATUS, lambda: ran.append("status")))
        await asyncio.sleep(0.05)
        assert ran == [], "the status patch is held behind the young Deployment apply"
        assert dispatcher.waiting(Urgency.STATUS) == 1 and dispatcher.in_flight(Urgency.DEPLOYMENT) == 1
        await asyncio.wait_for(status, timeout=2)
        assert ran == ["status"], "released once the Deployment apply outlived the hold"
        assert dispatcher.in_flight(Urgency.DEPLOYMENT) == 1
        release.set()
        await hanging

    try:
        asyncio.run(scenario())
    finally:
        dispatcher.close()
    assert ran == ["status", "deployment"]
