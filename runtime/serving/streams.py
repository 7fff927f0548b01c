"""Merging the output streams of a request's prompts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


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
