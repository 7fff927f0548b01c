"""Scale-down through the gateway costs no request: replicas that refuse requests because they are draining,
hand streams back, or are the last of their model leave every client with the answer an undisturbed replica
gives (the oracle: the same request to a replica of its own), but for its id and creation time."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from gateway_harness import model, queued, running_gateway, wait_until
from scripted_replica import Fault, ScriptedReplica, post, scripted, sse_chunks

CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def draining(name: str) -> ScriptedReplica:
    """A replica told to stop: it refuses every request as draining."""
    return ScriptedReplica(name, faults=[Fault("draining", times=None)])


def assert_same_answer(raw: bytes, expected_raw: bytes, stream: bool) -> None:
    if not stream:
        got, expected = json.loads(raw), json.loads(expected_raw)
        assert got == {**expected, "id": got["id"], "created": got["created"]}
        return
    got, expected = sse_chunks(raw), sse_chunks(expected_raw)
    heads = {(chunk["id"], chunk["created"]) for chunk in got if isinstance(chunk, dict)}
    assert len(heads) == 1, heads
    ((stream_id, created),) = heads
    assert got == [{**c, "id": stream_id, "created": created} if isinstance(c, dict) else c for c in expected]


def retries(registry: Any, reason: str) -> float:
    return registry.get_sample_value("kvfleet_gateway_retries_total", {"model": "m", "reason": reason}) or 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_draining_refusals_cost_no_attempt_and_the_replicas_are_passed_over(stream: bool) -> None:
    """Three replicas refuse as draining before discovery drops them; with one attempt allowed, the request
    still reaches the fourth, and the next request goes there at once."""

    async def scenario() -> None:
        body = {**CHAT, "stream": stream}
        replicas = [draining("d1"), draining("d2"), draining("d3"), ScriptedReplica("g")]
        async with scripted(*replicas, ScriptedReplica("oracle")) as fleet:
            config = model("m", *fleet[:4], policy="round-robin")
            async with running_gateway({"m": config}, max_attempts=1) as (gateway, _, url):
                answers = [await post(url, CHAT_PATH, body) for _ in range(2)]
                draining_retries = retries(gateway.metrics.registry, "draining")
            _, expected = await post(fleet[4].url, CHAT_PATH, body)
        for status, got in answers:
            assert status == 200, got
            assert_same_answer(got, expected, stream)
        assert [len(replica.received) for replica in fleet[:4]] == [1, 1, 1, 2]
        assert draining_retries == 3

    asyncio.run(scenario())


def test_a_replica_that_handed_a_stream_back_gets_no_new_request() -> None:
    async def scenario() -> None:
        handing_back = ScriptedReplica("a", faults=[Fault("drain", after=2)])
        async with scripted(handing_back, ScriptedReplica("b"), ScriptedReplica("c")) as fleet:
            config = model("m", *fleet, policy="round-robin")
            async with running_gateway({"m": config}) as (_, _, url):
                # a (handed back, resumed on b), then c, then b again: a's turn is passed over.
                statuses = [(await post(url, CHAT_PATH, {**CHAT, "stream": True}))[0] for _ in range(3)]
        assert statuses == [200, 200, 200]
        assert [len(replica.received) for replica in fleet] == [1, 2, 1]
        assert fleet[1].received[0]["continuation"]["choices"][0]["token_ids"]

    asyncio.run(scenario())


def test_a_continuation_refused_as_draining_costs_no_resume() -> None:
    async def scenario() -> None:
        handing_back = ScriptedReplica("a", faults=[Fault("drain", after=3)])
        replicas = [handing_back, draining("b"), ScriptedReplica("c"), ScriptedReplica("oracle")]
        async with scripted(*replicas) as fleet:
            config = model("m", *fleet[:3], policy="round-robin")
            body = {**CHAT, "stream": True}
            async with running_gateway({"m": config}, max_resumes=1) as (_, _, url):
                status, got = await post(url, CHAT_PATH, body)
            _, expected = await post(fleet[3].url, CHAT_PATH, body)
        assert status == 200, got
        assert_same_answer(got, expected, stream=True)
        assert len(fleet[1].continuations()) == 1 and len(fleet[2].continuations()) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [True, False])
def test_scaled_to_zero_mid_stream_the_gateway_holds_the_rest_until_a_replica_is_back(stream: bool) -> None:
    """The last replica hands its stream back as it goes: the continuation waits in the model's queue (the
    demand the operator scales up from zero on) and is served by the replica that comes up."""

    async def scenario() -> None:
        last = ScriptedReplica("a", faults=[Fault("drain", after=3)])
        body = {**CHAT, "stream": stream}
        async with scripted(last, ScriptedReplica("b"), ScriptedReplica("oracle")) as fleet:
            async with running_gateway({"m": model("m", last)}) as (gateway, discovery, url):
                answer = asyncio.create_task(post(url, CHAT_PATH, body))
                await wait_until(lambda: queued(gateway, "m") == 1)
                discovery.publish({"m": model("m", fleet[1])})
                status, got = await answer
            _, expected = await post(fleet[2].url, CHAT_PATH, body)
        assert status == 200, got
        assert_same_answer(got, expected, stream)
        assert len(fleet[1].continuations()) == 1

    asyncio.run(scenario())
