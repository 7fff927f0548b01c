"""The HTTP side of a generating request: racing the client's disconnect, and the service's answer framed as
JSON or as Server-Sent Events."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

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


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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


async def respond(raw_request: Request, service: OpenAIService, request: PreparedRequest) -> Response:
    """The service's answer to an admitted request: its JSON body, or its event stream once the first output
    is in. A client that goes away first aborts the request."""
    if request.stream:
        chunks = await unless_disconnected(raw_request, service.stream(request))
        return EventStreamResponse(sse_events(chunks))
    return JSONResponse(await unless_disconnected(raw_request, service.complete(request)))


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
