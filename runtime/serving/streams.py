"""Merging the output streams of a request's prompts, and a chat stream read as another API's events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kvfleet.contract.errors import OpenAIError
from kvfleet.runtime.errors import EngineError
from kvfleet.runtime.serving.errors import from_engine_error

T = TypeVar("T")
Events = list[dict[str, Any]]


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several async iterators, in arrival order. Closing the merge, or any iterator failing,
    closes them all."""
    # (item,) for an item, the exception a stream failed with, None for a stream that has ended.
    queue: asyncio.Queue[tuple[T] | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream) as owned:  # type: ignore[type-var]
                async for item in owned:
                    queue.put_nowait((item,))
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got[0]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def chat_stream_events(
    chunks: AsyncIterator[dict[str, Any]],
    read: Callable[[dict[str, Any]], Events],
    fail: Callable[[OpenAIError], Events],
    finish: Callable[[], Events],
) -> AsyncIterator[dict[str, Any]]:
    """The events `read` makes of each of a chat stream's chunks, then those `finish` makes; or, where the
    stream fails (the engine's errors as the API's), those `fail` makes of the error, and no more. The chunks
    are closed however it ends."""
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        try:
            async for chunk in chunks:
                for event in read(chunk):
                    yield event
        except (OpenAIError, EngineError) as raised:
            for event in fail(from_engine_error(raised) if isinstance(raised, EngineError) else raised):
                yield event
            return
    for event in finish():
        yield event
