"""vLLM's --sse-keep-alive-interval: a stream that waits for its first token opens with comments instead of
staying silent, and its tokens are then what an unstreamed request gets; a failure after it opened is its
last event; one that comes sooner keeps its status; a client leaving while it waits aborts it. Between
tokens, the comments are checked on the events a server streams, with gaps of a known length.

The server takes one sequence at a time, so a request sent while a long one runs waits in the queue for as
long as the test keeps that one running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from kvfleet.runtime.server.streaming import SSE_KEEP_ALIVE, with_keep_alive
from server_checks import RUNNING, WAITING, finished_count, occupied, until_metrics, wait_idle

if TYPE_CHECKING:
    from servers import ServerProcess

KEEP_ALIVE_S = 0.5
COMMENT = ": keep-alive"
# Long streams on the server's one sequence: together they run for longer than any test holds them.
OCCUPANTS = ["go on"] * 4
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(start_server: Any) -> ServerProcess:
    return start_server("--sse-keep-alive-interval", str(KEEP_ALIVE_S), "--max-num-seqs", "1")


async def _metric(server: ServerProcess, name: str) -> float:
    return (await asyncio.to_thread(server.metrics))[name]


class RawStream:
    """A streamed completion's status and lines, read as they come."""

    def __init__(self, server: ServerProcess, body: dict[str, Any]) -> None:
        self.status: int | None = None
        self.lines: list[str] = []
        self.body = ""
        self._task = asyncio.create_task(self._read(server, body))

    async def _read(self, server: ServerProcess, body: dict[str, Any]) -> None:
        async with (
            httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as client,
            client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
        ):
            self.status = response.status_code
            if response.status_code != 200:
                self.body = (await response.aread()).decode()
                return
            async for line in response.aiter_lines():
                if line:
                    self.lines.append(line)

    async def comments(self, count: int) -> None:
        """Waits until the stream has carried `count` comments."""
        while self.lines.count(COMMENT) < count:
            assert not self._task.done(), (self.status, self.body, self.lines)
            await asyncio.sleep(0.02)

    async def end(self) -> None:
        await asyncio.wait_for(self._task, 60)

    async def leave(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def data(self) -> list[str]:
        return [line.removeprefix("data: ") for line in self.lines if line.startswith("data: ")]


def _unstreamed_text(server: ServerProcess, body: dict[str, Any]) -> str:
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_queued_stream_opens_with_comments_then_streams_what_an_unstreamed_request_gets(
    server: ServerProcess,
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}

    async def run() -> RawStream:
        async with occupied(server, OCCUPANTS):
            stream = RawStream(server, body)
            await stream.comments(2)
            assert stream.status == 200 and stream.data() == [], "it opened with its first token, not before"
        await stream.end()
        return stream

    stream = asyncio.run(run())
    first_data = next(index for index, line in enumerate(stream.lines) if line.startswith("data: "))
    assert set(stream.lines[:first_data]) == {COMMENT}
    *chunks, done = stream.data()
    assert done == "[DONE]"
    text = "".join(json.loads(chunk)["choices"][0]["text"] for chunk in chunks)
    assert text == _unstreamed_text(server, body)
    wait_idle(server)


def test_the_openai_sdk_reads_a_chat_stream_that_opened_with_comments(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def streamed() -> str:
        async with occupied(server, OCCUPANTS):
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True
            )
            # Two more keep-alive periods in the queue (behind every occupant) before they let go.
            await asyncio.sleep(2.5 * KEEP_ALIVE_S)
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        return "".join(parts)

    text = asyncio.run(streamed())
    unstreamed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    answer = unstreamed.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert text == answer.choices[0].message.content
    wait_idle(server)


def test_a_failure_after_the_stream_opened_is_its_last_event(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "timeout": 3 * KEEP_ALIVE_S}

    async def run() -> tuple[RawStream, float]:
        async with occupied(server, OCCUPANTS):
            stream = RawStream(server, body)
            await stream.end()
            running = await _metric(server, RUNNING)
        return stream, running

    stream, running = asyncio.run(run())
    assert stream.status == 200
    assert stream.lines.count(COMMENT) >= 2
    *events, done = stream.data()
    assert done == "[DONE]" and len(events) == 1, stream.lines
    error = json.loads(events[0])["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "timeout"), error
    assert running == 1, "the request beside it was touched"
    wait_idle(server)


def test_a_responses_stream_opens_with_comments_and_its_failure_is_a_failed_response(
    server: ServerProcess,
) -> None:
    """The Responses API's typed events: the SDK reads a stream that opened with comments, and a deadline
    that passes while it waits ends it with the error event and the response failed."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    greedy: dict[str, Any] = {"model": "tiny", "input": PROMPT, "max_output_tokens": 16, "temperature": 0}

    async def run() -> tuple[str, list[str]]:
        async with occupied(server, OCCUPANTS):
            stream = await client.responses.create(**greedy, stream=True)
            await asyncio.sleep(2.5 * KEEP_ALIVE_S)
        text = "".join([event.delta async for event in stream if event.type == "response.output_text.delta"])
        async with (
            occupied(server, OCCUPANTS),
            httpx.AsyncClient(base_url=server.url, timeout=60) as http,
            http.stream(
                "POST", "/v1/responses", json={**greedy, "stream": True, "timeout": 3 * KEEP_ALIVE_S}
            ) as failing,
        ):
            assert failing.status_code == 200
            lines = [line async for line in failing.aiter_lines() if line]
        return text, lines

    text, lines = asyncio.run(run())
    unstreamed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert text and text == unstreamed.responses.create(**greedy).output_text
    assert lines.count(COMMENT) >= 2
    types = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert types == ["response.created", "response.in_progress", "error", "response.failed"], lines
    failed = json.loads(lines[-1].removeprefix("data: "))["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error", failed
    wait_idle(server)


def test_a_failure_before_the_interval_keeps_its_status(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "timeout": 0.05}

    async def run() -> RawStream:
        async with occupied(server, OCCUPANTS):
            stream = RawStream(server, body)
            await stream.end()
        return stream

    stream = asyncio.run(run())
    assert stream.status == 408, (stream.status, stream.lines)
    assert json.loads(stream.body)["error"]["code"] == "timeout", stream.body
    wait_idle(server)


def test_a_client_that_leaves_while_its_stream_waits_aborts_it(server: ServerProcess) -> None:
    aborted = finished_count(server, "abort")

    async def run() -> tuple[float, float]:
        async with occupied(server, OCCUPANTS):
            stream = RawStream(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8})
            await stream.comments(1)
            await stream.leave()
            await until_metrics(server, (WAITING,), len(OCCUPANTS) - 1)
            return await _metric(server, RUNNING), finished_count(server, "abort")

    running, aborted_while_held = asyncio.run(run())
    assert running == 1, "the occupants were touched"
    assert aborted_while_held == aborted + 1, "the waiting request was not aborted when its client left"
    wait_idle(server)


def test_an_idle_server_streams_without_comments(server: ServerProcess) -> None:
    async def run() -> RawStream:
        stream = RawStream(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
        await stream.end()
        return stream

    stream = asyncio.run(run())
    assert stream.status == 200 and COMMENT not in stream.lines and stream.data()[-1] == "[DONE]"


def _with_keep_alive(events: AsyncIterator[str], keep_alive_s: float) -> list[str]:
    async def run() -> list[str]:
        return [event async for event in with_keep_alive(events, keep_alive_s)]

    return asyncio.run(run())


def test_comments_fill_the_gaps_between_events_and_only_those() -> None:
    async def events() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield "data: 2\n\n"
        await asyncio.sleep(2.5 * KEEP_ALIVE_S)
        yield "data: 3\n\n"

    first, second, *gap, last = _with_keep_alive(events(), KEEP_ALIVE_S)
    assert (first, second, last) == ("data: 1\n\n", "data: 2\n\n", "data: 3\n\n")
    assert 1 <= len(gap) <= 2 and set(gap) == {SSE_KEEP_ALIVE}, gap


def test_a_stream_closed_in_a_gap_closes_the_events_it_waits_on() -> None:
    closed = []

    async def events() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(60)
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def run() -> list[str]:
        stream = with_keep_alive(events(), 0.05)
        sent = [await anext(stream), await anext(stream)]
        await stream.aclose()  # type: ignore[attr-defined]
        return sent

    assert asyncio.run(run()) == ["data: 1\n\n", SSE_KEEP_ALIVE]
    assert closed == [True], "the events were left waiting"
