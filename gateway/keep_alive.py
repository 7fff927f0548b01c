"""A stream the gateway holds (a completion's or a response's), kept alive (`kvfleet gateway
--sse-keep-alive-interval`).

A stream's client hears nothing until a replica sends its first token: the request may wait in the gateway's
queue, for a replica woken from zero, for a prefill, or in the replica's own queue, for longer than the read
timeout of a load balancer or proxy in front of the gateway, which then closes the connection. Held past the
interval, the stream is opened here (200, text/event-stream) and carries a comment (`: keep-alive`, which
clients skip) each interval until the answer takes it over; a replica's own comments go on to the client after
that (kvfleet.gateway.resumption). A failure after the stream opened is its last event, before [DONE], instead
of its status: as a failure mid-stream is (a Responses API stream's is its typed error event, with no [DONE]).
The gateway's request metrics count such a stream under the error's status, which an unheld request would have
been answered with (its span, under the 200 it sent, is marked failed with the error).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from aiohttp import web
from kvfleet.contract.errors import MESSAGES_PATH, OpenAIError
from kvfleet.gateway.requests import RESPONSES_PATH
from kvfleet.gateway.splice import DONE, answered_error
from kvfleet.gateway.tracing import failed

KEEP_ALIVE = b": keep-alive\n\n"
_STREAM_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class HeldStream:
    """The client's stream of one request, opened here once the request has been held `interval` seconds."""

    def __init__(self, request: web.Request, interval: float) -> None:
        self.request = request
        self.interval = interval
        self.response: web.StreamResponse | None = None
        self._claimed = False
        self._ended_with: int | None = None

    def claim(self) -> web.StreamResponse | None:
        """For the relay about to answer: the stream opened here (its status and headers sent), or None to
        answer as it would have. Either way, no more comments come from here."""
        self._claimed = True
        return self.response

    async def answer(self, forwarding: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """What `forwarding` answers, with comments while it holds the request; an error it raises or
        answers after the stream opened, as the stream's last event."""
        task = asyncio.ensure_future(forwarding)
        try:
            while not self._claimed:
                done, _ = await asyncio.wait({task}, timeout=self.interval)
                if done:
                    break
                if not self._claimed:
                    await self._keep_alive()
            answer = await task
        except OpenAIError as error:
            if self.response is None:
                raise
            return await self._end(error)
        finally:
            if not task.done():  # the client left, or the gateway is stopping
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.response is not None and answer is not self.response:
            # An answer made without the stream: the forwarding's refusal, or a replica's error.
            assert isinstance(answer, web.Response)
            return await self._end(answered_error(answer.status, answer.body or b""))
        return answer

    def status_of(self, answer: web.StreamResponse) -> int:
        """The status `answer` stands for: the error's that ended the stream opened here, else its own."""
        return answer.status if self._ended_with is None else self._ended_with

    async def _keep_alive(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers=_STREAM_HEADERS)
            await self.response.prepare(self.request)
        await self.response.write(KEEP_ALIVE)

    async def _end(self, error: OpenAIError) -> web.StreamResponse:
        assert self.response is not None
        failed(error.message)
        self._ended_with = error.status_code
        if self.request.path == RESPONSES_PATH:
            # Nothing came from a replica before: the error is the stream's first event.
            await self.response.write(error.to_response_event(0).encode())
        elif self.request.path == MESSAGES_PATH:
            await self.response.write(error.to_messages_event().encode())
        else:
            await self.response.write(error.to_sse().encode())
            await self.response.write(f"data: {DONE}\n\n".encode())
        await self.response.write_eof()
        return self.response
