"""Async plumbing of the handlers: racing the client's disconnect, merging request streams, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from kvfleet.runtime.server.errors import ClientDisconnectedError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as (iterator index, item), in arrival order. Closing the merge,
    or any iterator failing, closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return

    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream) as owned:  # type: ignore[type-var]
                async for item in owned:
                    queue.put_nowait((index, item, None, False))
        except Exception as exc:
            queue.put_nowait((index, None, exc, True))
        else:
            queue.put_nowait((index, None, None, True))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first: T | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


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
