"""`kvfleet gateway --sse-keep-alive-interval`: a streamed completion the gateway holds (here, for a model at
zero that a replica then joins) opens with keep-alive comments, then streams what a replica called directly
sends; one whose hold runs out ends with the error a gateway without keep-alives answers; a client that
leaves while held leaves the queue; a stream answered in time, and a request not streamed, are as before."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
from gateway_harness import WAIT_S, FakeReplica, model, queued, replicas, running_gateway, wait_until
from kvfleet.gateway.proxy import Gateway
from scripted_replica import KEEP_ALIVE, ScriptedReplica, post, scripted, sse_chunks

INTERVAL_S = 0.1
CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
RESPONSES_PATH = "/v1/responses"
RESPONSE = {"model": "m", "input": "hello", "stream": True}
MESSAGES_PATH = "/v1/messages"
MESSAGE = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], "stream": True}


class RawStream:
    """A client's streamed request: its status as soon as it is in, and its body as it comes."""

    def __init__(self, url: str, body: dict[str, Any], path: str = CHAT_PATH) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.raw = b""
        self._task = asyncio.create_task(self._read(f"{url}{path}", body))

    async def _read(self, url: str, body: dict[str, Any]) -> None:
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
            self.status, self.headers = answer.status, dict(answer.headers)
            async for chunk in answer.content.iter_any():
                self.raw += chunk

    async def comments(self, count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while self.raw.count(KEEP_ALIVE) < count:
                assert not self._task.done(), (self.status, self.raw)
                await asyncio.sleep(0.01)

    async def end(self) -> None:
        await asyncio.wait_for(self._task, WAIT_S)

    async def leave(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


AtZero = tuple[Gateway, Any, str, ScriptedReplica, ScriptedReplica]


@contextlib.asynccontextmanager
async def at_zero(
    **options: Any,
) -> AsyncIterator[tuple[Gateway, Any, str, ScriptedReplica, ScriptedReplica]]:
    """A gateway keeping held streams alive, serving model m from no replica: (gateway, its discovery, its
    URL, the replica that may join, and the oracle: a replica of its own)."""
    async with (
        scripted(ScriptedReplica("late"), ScriptedReplica("oracle")) as (late, oracle),
        running_gateway({"m": model("m", **options)}, sse_keep_alive_interval=INTERVAL_S) as (
            gateway,
            discovery,
            url,
        ),
    ):
        yield gateway, discovery, url, late, oracle


def _relabelled(chunks: list[Any], like: list[Any]) -> list[Any]:
    """`chunks` under the id and creation time of `like`'s (the two replicas each name their own)."""
    head = next(chunk for chunk in like if isinstance(chunk, dict))
    return [
        {**chunk, "id": head["id"], "created": head["created"]} if isinstance(chunk, dict) else chunk
        for chunk in chunks
    ]


def test_a_held_stream_opens_with_comments_then_streams_the_replicas_answer() -> None:
    async def scenario() -> tuple[RawStream, bytes, tuple[int, bytes]]:
        async with at_zero(hold_seconds=WAIT_S) as (gateway, discovery, url, late, oracle):
            stream = RawStream(url, CHAT)
            unstreamed = asyncio.create_task(post(url, CHAT_PATH, {**CHAT, "stream": False}))
            await stream.comments(2)
            assert stream.status == 200 and queued(gateway, "m") == 2
            assert not unstreamed.done()
            discovery.publish({"m": model("m", late, hold_seconds=WAIT_S)})
            await stream.end()
            _, expected = await post(oracle.url, CHAT_PATH, CHAT)
            return stream, expected, await unstreamed

    stream, expected, (status, whole) = asyncio.run(scenario())
    assert stream.headers["Content-Type"] == "text/event-stream"
    events = sse_chunks(stream.raw)
    assert stream.raw.startswith(KEEP_ALIVE) and events == _relabelled(sse_chunks(expected), events)
    # Not streamed: held in silence, then answered whole.
    assert status == 200 and KEEP_ALIVE not in whole and json.loads(whole)["choices"]


def test_the_openai_sdk_reads_a_stream_the_gateway_held() -> None:
    async def scenario() -> tuple[str, str]:
        async with at_zero(hold_seconds=WAIT_S) as (_, discovery, url, late, oracle):
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            stream = await sdk.chat.completions.create(model="m", messages=CHAT["messages"], stream=True)
            await asyncio.sleep(3 * INTERVAL_S)
            discovery.publish({"m": model("m", late, hold_seconds=WAIT_S)})
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            direct = openai.AsyncOpenAI(base_url=f"{oracle.url}/v1", api_key="unused", max_retries=0)
            answer = await direct.chat.completions.create(model="m", messages=CHAT["messages"])
            return text, answer.choices[0].message.content or ""

    text, expected = asyncio.run(scenario())
    assert text and text == expected


def _answered(gateway: Gateway, status: str) -> float:
    return (
        gateway.metrics.registry.get_sample_value(
            "kvfleet_gateway_requests_total", {"model": "m", "status": status}
        )
        or 0.0
    )


def test_a_hold_that_runs_out_ends_the_stream_with_the_error_an_unheld_request_gets() -> None:
    async def scenario() -> tuple[RawStream, bytes, list[float]]:
        async with at_zero(hold_seconds=5 * INTERVAL_S) as (gateway, _, url, _, _):
            stream = RawStream(url, CHAT)
            await stream.end()
            # Counted as the unheld request is, not as the 200 that opened the stream.
            counted = [_answered(gateway, "503"), _answered(gateway, "200")]
        async with running_gateway({"m": model("m", hold_seconds=5 * INTERVAL_S)}) as (_, _, silent):
            status, answer = await post(silent, CHAT_PATH, CHAT)
        assert status == 503
        return stream, answer, counted

    stream, unheld, counted = asyncio.run(scenario())
    assert stream.status == 200 and stream.raw.count(KEEP_ALIVE) >= 2
    *errors, done = sse_chunks(stream.raw)
    assert done == "[DONE]" and errors == [json.loads(unheld)]
    assert counted == [1.0, 0.0]


def test_a_client_that_leaves_while_held_leaves_the_queue() -> None:
    async def scenario() -> tuple[float, int]:
        async with at_zero(hold_seconds=WAIT_S) as (gateway, discovery, url, late, _):
            stream = RawStream(url, CHAT)
            await stream.comments(1)
            await stream.leave()
            await wait_until(lambda: queued(gateway, "m") == 0)
            discovery.publish({"m": model("m", late, hold_seconds=WAIT_S)})
            status, _ = await post(url, CHAT_PATH, {**CHAT, "stream": False})
            return queued(gateway, "m"), status

    assert asyncio.run(scenario()) == (0, 200)


def test_a_stream_answered_within_the_interval_is_the_replicas_own() -> None:
    async def scenario() -> RawStream:
        async with (
            scripted(ScriptedReplica("ready")) as (ready,),
            running_gateway({"m": model("m", ready)}, sse_keep_alive_interval=1.0) as (_, _, url),
        ):
            stream = RawStream(url, CHAT)
            await stream.end()
            return stream

    stream = asyncio.run(scenario())
    assert stream.status == 200 and KEEP_ALIVE not in stream.raw
    assert stream.headers["x-replica"] == "ready" and sse_chunks(stream.raw)[-1] == "[DONE]"


def typed_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A Responses API stream's events: each one's `event:` name and its data."""
    events = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_held_responses_stream_is_kept_alive_and_the_sdk_reads_it() -> None:
    async def scenario() -> tuple[RawStream, list[Any], bytes]:
        async with (
            replicas(FakeReplica("late"), FakeReplica("oracle")) as (late, oracle),
            running_gateway({"m": model("m", hold_seconds=WAIT_S)}, sse_keep_alive_interval=INTERVAL_S) as (
                gateway,
                discovery,
                url,
            ),
        ):
            raw = RawStream(url, RESPONSE, RESPONSES_PATH)
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            stream = await sdk.responses.create(model="m", input="hello", stream=True)
            await raw.comments(2)
            assert raw.status == 200 and queued(gateway, "m") == 2
            discovery.publish({"m": model("m", late, hold_seconds=WAIT_S)})
            await raw.end()
            events = [event async for event in stream]
            _, expected = await post(oracle.url, RESPONSES_PATH, RESPONSE)
            return raw, events, expected

    raw, events, expected = asyncio.run(scenario())
    assert raw.raw.startswith(KEEP_ALIVE) and b"[DONE]" not in raw.raw
    names = [name for name, _ in typed_events(raw.raw)]
    assert names == [name for name, _ in typed_events(expected)]
    assert [event.type for event in events] == names and events[-1].response.output_text == "late"


def test_a_held_responses_stream_that_runs_out_ends_with_the_typed_error_event() -> None:
    """OpenAI's `error` event, numbered first, with the code and message an unheld request is answered with;
    the openai SDK gives it as an event, as it does a replica's."""

    async def scenario() -> tuple[RawStream, list[Any], bytes]:
        options = {"hold_seconds": 5 * INTERVAL_S}
        async with running_gateway({"m": model("m", **options)}, sse_keep_alive_interval=INTERVAL_S) as (
            _,
            _,
            url,
        ):
            raw = RawStream(url, RESPONSE, RESPONSES_PATH)
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            events = [event async for event in await sdk.responses.create(model="m", input="x", stream=True)]
            await raw.end()
        async with running_gateway({"m": model("m", **options)}) as (_, _, silent):
            status, answer = await post(silent, RESPONSES_PATH, RESPONSE)
        assert status == 503
        return raw, events, answer

    raw, events, unheld = asyncio.run(scenario())
    assert raw.status == 200 and raw.raw.count(KEEP_ALIVE) >= 2 and b"[DONE]" not in raw.raw
    error = json.loads(unheld)["error"]
    expected = {"type": "error", "sequence_number": 0, "code": error["code"], "message": error["message"]}
    assert typed_events(raw.raw) == [("error", {**expected, "param": None})]
    (event,) = events
    assert (event.type, event.sequence_number, event.code, event.message) == tuple(expected.values())


def test_a_responses_stream_its_replica_breaks_off_ends_with_the_next_typed_error_event() -> None:
    async def scenario() -> bytes:
        async with (
            replicas(FakeReplica("a", die_after_first_chunk=True)) as (replica,),
            running_gateway({"m": model("m", replica)}) as (_, _, url),
        ):
            status, raw = await post(url, RESPONSES_PATH, RESPONSE)
            assert status == 200
            return raw

    (first, first_data), (name, error) = typed_events(asyncio.run(scenario()))
    assert (first, first_data["sequence_number"]) == ("response.created", 0)
    assert name == "error" and error["sequence_number"] == 1 and error["code"] == "upstream_failed"


def test_a_held_messages_stream_is_kept_alive_and_anthropics_client_reads_it() -> None:
    async def scenario() -> tuple[RawStream, list[str], bytes]:
        async with (
            replicas(FakeReplica("late"), FakeReplica("oracle")) as (late, oracle),
            running_gateway({"m": model("m", hold_seconds=WAIT_S)}, sse_keep_alive_interval=INTERVAL_S) as (
                gateway,
                discovery,
                url,
            ),
            anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as sdk,
        ):
            raw = RawStream(url, MESSAGE, MESSAGES_PATH)
            asked = MESSAGE["messages"]
            async with sdk.messages.stream(model="m", max_tokens=4, messages=asked) as stream:  # type: ignore[arg-type]
                await raw.comments(2)
                assert raw.status == 200 and queued(gateway, "m") == 2
                discovery.publish({"m": model("m", late, hold_seconds=WAIT_S)})
                texts = [text async for text in stream.text_stream]
            await raw.end()
            _, expected = await post(oracle.url, MESSAGES_PATH, MESSAGE)
            return raw, texts, expected

    raw, texts, expected = asyncio.run(scenario())
    assert raw.raw.startswith(KEEP_ALIVE) and b"[DONE]" not in raw.raw
    assert [name for name, _ in typed_events(raw.raw)] == [name for name, _ in typed_events(expected)]
    assert texts == ["late"]


def test_a_held_messages_stream_that_runs_out_ends_with_anthropics_error_event() -> None:
    """The error an unheld request is answered with, in Anthropic's shape, as the stream's one event."""

    async def scenario() -> tuple[RawStream, int, bytes]:
        options = {"hold_seconds": 5 * INTERVAL_S}
        async with running_gateway({"m": model("m", **options)}, sse_keep_alive_interval=INTERVAL_S) as (
            _,
            _,
            url,
        ):
            raw = RawStream(url, MESSAGE, MESSAGES_PATH)
            await raw.end()
        async with running_gateway({"m": model("m", **options)}) as (_, _, silent):
            status, answer = await post(silent, MESSAGES_PATH, MESSAGE)
        return raw, status, answer

    raw, status, unheld = asyncio.run(scenario())
    assert status == 503 and raw.status == 200 and raw.raw.count(KEEP_ALIVE) >= 2
    error = json.loads(unheld)
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert typed_events(raw.raw) == [("error", error)]
