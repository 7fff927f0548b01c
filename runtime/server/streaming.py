"""The HTTP side of a generating request: racing the client's disconnect, and the service's answer framed as
JSON or as Server-Sent Events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from kvfleet.runtime.errors import EngineError
from kvfleet.runtime.server.errors import ClientDisconnectedError, OpenAIError
from kvfleet.runtime.serving.errors import from_engine_error
from kvfleet.runtime.serving.service import OpenAIService, PreparedRequest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"
# A comment line, which clients skip: it keeps a quiet stream's connection from looking idle to the proxies
# between a client and the server, which close connections that carry nothing for their read timeout.
SSE_KEEP_ALIVE = ": keep-alive\n\n"
# Every token of every stream is an event to encode: msgspec takes a tenth of json.dumps' time, and writes it
# without spaces, as OpenAI's and vLLM's streams are written. (It writes a float that is not a number as null,
# where json.dumps would write NaN, which is not JSON.)
_JSON = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {_JSON.encode(payload).decode()}\n\n"


def typed_sse_event(payload: dict[str, Any]) -> str:
    """An event that names its type, as the Responses API's do (no [DONE] follows the last one)."""
    return f"event: {payload['type']}\n{sse_event(payload)}"


async def wait_for_disconnect(request: Request) -> None:
    # Once the body has been read, the server's next message for this request is its disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, unless the client goes away first: then it is cancelled (which aborts the engine
    request it was waiting on) and ClientDisconnectedError is raised."""
    work = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnectedError(request.url.path)
    return work.result()


async def respond(
    raw_request: Request, service: OpenAIService, request: PreparedRequest, keep_alive_s: float
) -> Response:
    """The service's answer to an admitted request: its JSON body, or its event stream once the first output
    is in (see stream_response). A client that goes away first aborts the request."""
    if not request.stream:
        return JSONResponse(await unless_disconnected(raw_request, service.complete(request)))
    return await stream_response(raw_request, service.stream(request), sse_events, keep_alive_s)


async def stream_response(
    raw_request: Request,
    opening: Awaitable[AsyncIterator[T]],
    framed: Callable[[AsyncIterator[T]], AsyncIterator[str]],
    keep_alive_s: float,
) -> Response:
    """The event stream of what `opening` gives once a request's first output is in, as `framed` writes it
    (which ends a stream that fails with its error as events).

    With `keep_alive_s` (vLLM's --sse-keep-alive-interval), a stream whose first output takes longer opens
    then, and carries a comment each time it has been quiet that long: in the queue, in a long prefill,
    between tokens. A failure before its first output is then the stream's last events, not its status."""
    if not keep_alive_s:
        return EventStreamResponse(framed(await unless_disconnected(raw_request, opening)))
    opened = asyncio.ensure_future(opening)
    try:
        await unless_disconnected(raw_request, asyncio.wait({opened}, timeout=keep_alive_s))
    except BaseException:  # the client gone, or the server stopping: the request is not left running
        await _cancelled(opened)
        raise
    if opened.done():
        # In time for the request's status to be its own: a failure before its first output is a 4xx or 5xx.
        return EventStreamResponse(with_keep_alive(framed(opened.result()), keep_alive_s))
    events = with_keep_alive(framed(_once_opened(opened)), keep_alive_s)
    return EventStreamResponse(_preceded_by(SSE_KEEP_ALIVE, events))


async def _cancelled(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _once_opened(opening: asyncio.Future[AsyncIterator[T]]) -> AsyncIterator[T]:
    """What `opening` gives, once it does; its failure is raised at the first item. Closing this before
    then cancels it (which aborts its engine request)."""
    try:
        items = await opening
    finally:
        if not opening.done():
            await _cancelled(opening)
    async with contextlib.aclosing(items):  # type: ignore[type-var]
        async for item in items:
            yield item


async def _preceded_by(first: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for event in events:
            yield event


async def with_keep_alive(events: AsyncIterator[str], keep_alive_s: float) -> AsyncIterator[str]:
    """`events`, with SSE_KEEP_ALIVE each time none has come for `keep_alive_s` seconds."""
    following: asyncio.Future[str] | None = None
    try:
        while True:
            if following is None:
                following = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({following}, timeout=keep_alive_s)
            if not done:
                yield SSE_KEEP_ALIVE
                continue
            try:
                event = following.result()
            except StopAsyncIteration:
                return
            following = None
            yield event
    finally:
        # A response cut short (the client gone) stops the event being awaited before closing the events.
        if following is not None and not following.done():
            await _cancelled(following)
        await events.aclose()  # type: ignore[attr-defined]


async def sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The chunks as events, ended by [DONE]; a failure mid-stream is the last event before it."""
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        try:
            async for body in chunks:
                yield sse_event(body)
        except (OpenAIError, EngineError) as raised:
            error = from_engine_error(raised) if isinstance(raised, EngineError) else raised
            yield error.to_sse()
    yield SSE_DONE


async def typed_sse_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for event in events:
            yield typed_sse_event(event)


class EventStreamResponse(StreamingResponse):
    """Server-Sent Events whose generator is always closed when the response ends, so that a client gone
    mid-stream aborts its engine request now rather than when the generator is garbage collected."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
