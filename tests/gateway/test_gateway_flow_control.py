"""Flow control through the real gateway: one replica held busy, requests queued by tier, shed and refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from gateway_harness import WAIT_S, FakeReplica, model, queued, replicas, running_gateway, wait_until
from kvfleet.gateway.proxy import Gateway
from kvfleet.operator.scrape import GatewayQueue, parse_gateway_queues

CHAT = [{"role": "user", "content": "hello"}]


async def post(
    url: str, tag: str, tier: str | None = None, **headers: str
) -> tuple[int, dict[str, Any], str]:
    """(status, JSON body, Retry-After) of one chat request; `tag` is the prompt, to tell requests apart."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": tag}]}
    if tier is not None:
        body["priority"] = tier
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.json(), answer.headers.get("Retry-After", "")


def tags(replica: FakeReplica) -> list[str]:
    return [body["messages"][0]["content"] for body in replica.received]


async def queue(gateway: Gateway, url: str, tag: str, tier: str | None, **headers: str) -> asyncio.Task[Any]:
    """Sends a request and returns once it waits in the model's queue."""
    before = queued(gateway, "m")
    task = asyncio.create_task(post(url, tag, tier, **headers))
    await wait_until(lambda: queued(gateway, "m") == before + 1 or task.done())
    return task


@asynccontextmanager
async def one_busy_replica(
    tier: str = "critical", replicas_preempt: bool = False, **options: Any
) -> AsyncIterator[tuple[Gateway, str, FakeReplica, asyncio.Task[Any]]]:
    """A gateway in front of one replica that takes one request at a time and holds the request "first", of
    `tier` (by default the most urgent, so that every other request waits), until the test releases it:
    (gateway, its URL, the replica, the request in flight)."""
    settings = {"max_in_flight": 1, "replicas_preempt": replicas_preempt}
    async with (
        replicas(FakeReplica("r", gated=True)) as (replica,),
        running_gateway({"m": model("m", replica, **settings)}, **options) as (gateway, _, url),
    ):
        busy = asyncio.create_task(post(url, "first", tier))
        await wait_until(lambda: len(replica.received) == 1)
        yield gateway, url, replica, busy


def test_queued_requests_go_out_by_tier_then_in_arrival_order() -> None:
    async def scenario() -> None:
        async with one_busy_replica() as (gateway, url, replica, busy):
            order = [
                ("b1", "batch"),
                ("s1", "standard"),
                ("c1", "critical"),
                ("s2", None),
                ("h1", "high"),
            ]
            waiting = [await queue(gateway, url, tag, tier) for tag, tier in order]
            for _ in range(len(order) + 1):
                replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(busy, *waiting), WAIT_S)
            assert [status for status, _, _ in results] == [200] * 6
            # A request without a tier is the service's default (standard), queued after s1.
            assert tags(replica) == ["first", "c1", "h1", "s1", "s2", "b1"]

    asyncio.run(scenario())


def test_a_more_urgent_request_is_not_held_behind_less_urgent_ones_in_flight() -> None:
    # The replica preempts less urgent work to run it: the cap counts only requests at least as urgent.
    async def scenario() -> None:
        async with one_busy_replica("batch", replicas_preempt=True) as (gateway, url, replica, busy):
            critical = asyncio.create_task(post(url, "c1", "critical"))
            await wait_until(lambda: len(replica.received) == 2)
            assert queued(gateway, "m") == 0
            # One request of each is in flight: another batch one waits for both, another critical one for c1.
            batch = await queue(gateway, url, "b2", "batch")
            second_critical = await queue(gateway, url, "c2", "critical")
            for _ in range(4):
                replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(busy, critical, batch, second_critical), WAIT_S)
            assert [status for status, _, _ in results] == [200] * 4
            assert tags(replica) == ["first", "c1", "c2", "b2"]

    asyncio.run(scenario())


def test_less_urgent_tiers_leave_places_for_more_urgent_ones_on_a_first_come_first_served_replica() -> None:
    # Such a replica runs its requests in arrival order, so the gateway keeps its last places for urgent ones.
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r", gated=True)) as (replica,),
            running_gateway({"m": model("m", replica, max_in_flight=4)}) as (gateway, _, url),
        ):
            # Critical requests come now and then, so their places are kept.
            earlier = asyncio.create_task(post(url, "c0", "critical"))
            await wait_until(lambda: len(replica.received) == 1)
            replica.permits.release()
            assert (await asyncio.wait_for(earlier, WAIT_S))[0] == 200
            in_flight = []
            # Of 4 places, batch requests take 2 at most and standard ones 3 in all.
            for tag, tier in (("b1", "batch"), ("b2", "batch"), ("s1", "standard")):
                in_flight.append(asyncio.create_task(post(url, tag, tier)))
                await wait_until(lambda: len(replica.received) == len(in_flight) + 1)
            waiting = [await queue(gateway, url, "b3", "batch"), await queue(gateway, url, "s2", "standard")]
            # The last place is the critical request's, at once.
            in_flight.append(asyncio.create_task(post(url, "c1", "critical")))
            await wait_until(lambda: len(replica.received) == 5)
            assert queued(gateway, "m") == 2
            for _ in range(6):
                replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(*in_flight, *waiting), WAIT_S)
            assert [status for status, _, _ in results] == [200] * 6
            assert tags(replica) == ["c0", "b1", "b2", "s1", "c1", "s2", "b3"]

    asyncio.run(scenario())


def test_requests_of_one_tier_take_every_place_of_a_first_come_first_served_replica() -> None:
    # No more urgent tier has asked: keeping places for one would only leave them idle.
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r", gated=True)) as (replica,),
            running_gateway({"m": model("m", replica, max_in_flight=4)}) as (gateway, _, url),
        ):
            in_flight = [asyncio.create_task(post(url, f"b{number}", "batch")) for number in range(4)]
            await wait_until(lambda: len(replica.received) == 4)
            fifth = await queue(gateway, url, "b4", "batch")
            for _ in range(5):
                replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(*in_flight, fifth), WAIT_S)
            assert [status for status, _, _ in results] == [200] * 5

    asyncio.run(scenario())


def test_batch_requests_wait_while_others_are_in_flight_on_a_first_come_first_served_replica() -> None:
    # Such a replica starts background requests only when no other is present: the gateway holds them.
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r", gated=True)) as (replica,),
            running_gateway({"m": model("m", replica, max_in_flight=4)}) as (gateway, _, url),
        ):
            standard = asyncio.create_task(post(url, "s1", "standard"))
            await wait_until(lambda: len(replica.received) == 1)
            batch = await queue(gateway, url, "b1", "batch")
            assert tags(replica) == ["s1"]
            replica.permits.release()
            await wait_until(lambda: len(replica.received) == 2)
            replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(standard, batch), WAIT_S)
            assert [status for status, _, _ in results] == [200, 200]
            assert tags(replica) == ["s1", "b1"]

    asyncio.run(scenario())


def test_a_full_queue_sheds_its_lowest_tier_first_and_refuses_with_429() -> None:
    async def scenario() -> None:
        async with one_busy_replica(max_queue=2) as (gateway, url, replica, busy):
            batch = await queue(gateway, url, "b1", "batch")
            standard = await queue(gateway, url, "s1", "standard")
            # Full: a critical arrival takes the batch request's place.
            critical = asyncio.create_task(post(url, "c1", "critical"))
            status, body, retry_after = await asyncio.wait_for(batch, WAIT_S)
            assert (status, body["error"]["code"]) == (429, "shed") and int(retry_after) > 0
            # Still full, with nothing less urgent than a new standard request: refused at once.
            status, body, retry_after = await post(url, "s2", "standard")
            assert (status, body["error"]["code"]) == (429, "queue_full") and int(retry_after) > 0
            for _ in range(3):
                replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(busy, standard, critical), WAIT_S)
            assert [status for status, _, _ in results] == [200, 200, 200]
            assert tags(replica) == ["first", "c1", "s1"]
            async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as answer:
                metrics = await answer.text()
        assert 'kvfleet_gateway_rejected_total{model="m",reason="shed",tier="batch"} 1.0' in metrics
        assert 'kvfleet_gateway_rejected_total{model="m",reason="queue_full",tier="standard"} 1.0' in metrics
        # b1, s1 and c1 waited in the queue; "first" found the replica free, and s2 was refused at once.
        for tier in ("batch", "standard", "critical"):
            assert f'kvfleet_gateway_held_total{{model="m",tier="{tier}"}} 1.0' in metrics
        # What the operator's autoscaler reads of it: three sent to the replica, two refused, three waited.
        assert parse_gateway_queues(metrics)["m"] == GatewayQueue(
            held=0.0, routed=3.0, refused=2.0, waited=3.0
        )

    asyncio.run(scenario())


def test_a_request_past_its_deadline_in_the_queue_gets_429() -> None:
    async def scenario() -> None:
        async with one_busy_replica() as (gateway, url, replica, busy):
            status, body, retry_after = await post(url, "late", None, **{"x-kvfleet-deadline-ms": "50"})
            assert (status, body["error"]["code"]) == (429, "deadline_exceeded") and int(retry_after) > 0
            assert queued(gateway, "m") == 0
            replica.permits.release()
            assert (await asyncio.wait_for(busy, WAIT_S))[0] == 200
            assert tags(replica) == ["first"]

    asyncio.run(scenario())


def test_a_client_that_leaves_the_queue_frees_its_place() -> None:
    async def scenario() -> None:
        async with one_busy_replica() as (gateway, url, replica, busy):
            leaving = await queue(gateway, url, "gone", "critical")
            staying = await queue(gateway, url, "kept", "batch")
            leaving.cancel()
            await wait_until(lambda: queued(gateway, "m") == 1)
            replica.permits.release()
            replica.permits.release()
            results = await asyncio.wait_for(asyncio.gather(busy, staying), WAIT_S)
            assert [status for status, _, _ in results] == [200, 200]
            assert tags(replica) == ["first", "kept"]

    asyncio.run(scenario())
