"""A completion or chat completion relayed to its client across the replicas that serve it in turn.

A replica's stream that breaks off before its [DONE] (its connection reset or closed, a 5xx error frame, no
chunk within the stall timeout, or the hand-back frame of a draining replica) is resumed on another replica:
the client's request again, with the `continuation` of what was received (kvfleet.gateway.splice), and that
replica's stream is spliced onto the client's. The failed replica is not chosen again for the request. A
replica that hands a request back, or refuses a continuation, because it is draining is passed over by every
request for a while (kvfleet.gateway.routing.DRAIN_MEMORY_S), and such a refusal costs the request no resume.
A request is resumed at most `max_resumes` times; past that, or when no replica takes the continuation, the
client gets an error (an error frame and [DONE] on a stream). An error frame that is the request's own (a 4xx)
ends the stream as the replica sent it. A client that did not ask for a stream gets the answer assembled
(kvfleet.gateway.assembly) once the last stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from kvfleet.contract.errors import GatewayTimeoutError, OpenAIError, ServiceUnavailableError
from kvfleet.gateway.assembly import Assembly
from kvfleet.gateway.http_errors import error_response
from kvfleet.gateway.keep_alive import HeldStream
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.routing import Replica
from kvfleet.gateway.splice import DONE, EventReader, Failure, Splice, frame_error, frame_failure
from kvfleet.gateway.tracing import failed, note

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESUMES = 3
# A replica's stream ends right after its [DONE]: read to its end within this, the connection is kept for
# another request.
END_AFTER_DONE_S = 1.0
# Headers of a stream that a JSON answer made of it does not carry.
_STREAM_HEADERS = frozenset({"content-type", "cache-control", "x-accel-buffering"})
# Every relayed token's chunk is read and written again: msgspec does each in a fifth of json's time (0.7
# against 5.8 us a write, 1.3 against 4.6 a read). Its reader refuses NaN and Infinity, which are not JSON and
# which neither kvfleet's runtime nor vLLM writes; a chunk holding them is a malformed one.
_encode_chunk = msgspec.json.Encoder().encode


@dataclass
class Leg:
    """One replica's stream of the request; `close` hands its connection and its place in the pool back."""

    replica: Replica
    upstream: aiohttp.ClientResponse
    give_back: Callable[[], None]
    closed: bool = field(default=False, init=False)

    @property
    def url(self) -> str:
        return self.replica.url

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # A response read to its end leaves a connection to reuse; any other is closed, which is how a
        # replica learns that its client left.
        if self.upstream.content.at_eof():
            self.upstream.release()
        else:
            self.upstream.close()
        self.give_back()


class LegUnavailable(Exception):
    """The replica chosen for a continuation could not be reached, or answered 5xx: another is tried.
    `draining`: it refused the continuation because it is draining, which costs the request no resume."""

    def __init__(self, url: str, detail: str, *, draining: bool = False) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.draining = draining


# A leg continuing from the continuation given (None: the request afresh), on a replica not among those
# tried. Raises LegUnavailable, or the OpenAIError that is the client's answer.
OpenLeg = Callable[[dict[str, Any] | None, list[str]], Awaitable[Leg]]


class Generation:
    """One request's relay, from its first replica's stream to its end."""

    def __init__(
        self,
        request: web.Request,
        splice: Splice,
        open_leg: OpenLeg,
        metrics: GatewayMetrics,
        model: str,
        *,
        streamed: bool,
        max_resumes: int,
        stall: float,
        deadline: float,
    ) -> None:
        """`streamed`: whether the client asked for a stream; `stall`: the seconds a stream may go without a
        byte; `deadline`: when (loop time) the whole answer must be in."""
        self.request = request
        self.splice = splice
        self.open_leg = open_leg
        self.metrics = metrics
        self.model = model
        self.assembly = None if streamed else Assembly(splice.chat)
        self.max_resumes = max_resumes
        self.stall = stall
        self.deadline = deadline
        self.response: web.StreamResponse | None = None
        self._failed_at: float | None = None

    async def relay(
        self, leg: Leg, headers: list[tuple[str, str]], tried: list[str], held: HeldStream | None
    ) -> web.StreamResponse:
        """The client's response, from `leg` (whose response `headers` it answers with, unless `held` opened
        the stream already) and the legs that resume it; `tried`: the replicas the request went to."""
        if self.assembly is None:
            self.response = held.claim() if held is not None else None
            if self.response is None:
                self.response = web.StreamResponse(status=200, headers=headers)
                await self.response.prepare(self.request)
        resumes = 0
        while True:
            try:
                outcome = await self._pump(leg)
                if outcome is None:
                    # Before the client's end: a client that leaves once it has its answer cancels this.
                    await _read_to_end(leg.upstream)
            finally:
                leg.close()
            if outcome is None:
                return await self._finish(headers)
            if isinstance(outcome, OpenAIError):
                return await self._fail(outcome)
            tried.append(leg.url)
            if outcome.cause == "drain":
                leg.replica.drains()
            self.metrics.resume.resumes.labels(self.model, outcome.cause).inc()
            note("stream_broke", url=leg.url, cause=outcome.cause)
            self._failed_at = time.monotonic()
            logger.info(
                "%s: %s broke off its stream (%s: %s); resuming",
                self.model,
                leg.url,
                outcome.cause,
                outcome.detail,
            )
            try:
                leg, resumes = await self._resumed(resumes, tried)
            except OpenAIError as error:
                return await self._fail(error)

    async def _resumed(self, resumes: int, tried: list[str]) -> tuple[Leg, int]:
        """A leg continuing the request, and the resumes made so far."""
        while resumes < self.max_resumes:
            resumes += 1
            continuation = self.splice.continuation()
            self.metrics.resume.resumed_tokens.labels(self.model).inc(self.splice.replayed_tokens())
            try:
                return await self.open_leg(continuation, tried), resumes
            except LegUnavailable as unavailable:
                tried.append(unavailable.url)
                if unavailable.draining:
                    resumes -= 1
                logger.info("%s: the continuation failed (%s)", self.model, unavailable)
        raise ServiceUnavailableError(
            f"the replicas serving model {self.model!r} failed mid-stream and the request was resumed "
            f"{self.max_resumes} times, the most it may be",
            code="upstream_failed",
        )

    async def _pump(self, leg: Leg) -> Failure | OpenAIError | None:
        """Relays a leg's chunks until its [DONE] (None), its failure, or an error to end with."""
        reader = EventReader()
        loop = asyncio.get_running_loop()
        try:
            while True:
                async with asyncio.timeout_at(min(loop.time() + self.stall, self.deadline)):
                    data = await leg.upstream.content.readany()
                if not data:
                    return Failure("reset", "the stream ended before [DONE]")
                events = reader.feed(data)
                # Before the events: [DONE] among them ends the relay.
                for comment in reader.take_comments():
                    await self._comment(comment)
                for event in events:
                    if event.strip() == DONE:
                        self._resumed_output()
                        return None
                    outcome = await self._event(event)
                    if outcome is not None:
                        return outcome
        except aiohttp.ClientError as error:
            return Failure("reset", str(error) or type(error).__name__)
        except ValueError as error:
            return Failure("error", str(error))
        except TimeoutError:
            if loop.time() < self.deadline:
                return Failure("stall", f"no chunk within {self.stall:g} s")
            return GatewayTimeoutError(
                f"the replicas serving model {self.model!r} did not finish the answer in time",
                code="upstream_timeout",
            )

    async def _event(self, event: str) -> Failure | OpenAIError | None:
        try:
            chunk = msgspec.json.decode(event)
            if "error" in chunk:
                error = chunk["error"]
                return frame_failure(error) or frame_error(error)
            sent = self.splice.accept(chunk)
            carries_tokens = any(choice.get("token_ids") for choice in chunk.get("choices") or ())
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            return Failure("error", f"a malformed chunk ({error!r})")
        for body in sent:
            await self._send(body)
        if carries_tokens:
            self._resumed_output()
        return None

    async def _comment(self, line: bytes) -> None:
        """A replica's comment (its keep-alive while the request waits or between tokens) goes on to a
        streaming client, whose own proxies would otherwise see the stream as quiet."""
        if self.response is not None:
            await self.response.write(line + b"\n\n")

    def _resumed_output(self) -> None:
        """A resumed stream's first token (or its end) is in: the resume's latency, from the failure."""
        if self._failed_at is not None:
            self.metrics.resume.resume_seconds.labels(self.model).observe(time.monotonic() - self._failed_at)
            self._failed_at = None

    async def _send(self, body: dict[str, Any]) -> None:
        if self.assembly is not None:
            self.assembly.add(body)
            return
        assert self.response is not None
        await self.response.write(b"data: " + _encode_chunk(body) + b"\n\n")

    async def _finish(self, headers: list[tuple[str, str]]) -> web.StreamResponse:
        if self.assembly is not None:
            kept = [(name, value) for name, value in headers if name.lower() not in _STREAM_HEADERS]
            answer = web.json_response(self.assembly.answer(self.splice.usage))
            answer.headers.extend(kept)
            return answer
        assert self.response is not None
        for body in self.splice.ending():
            await self._send(body)
        return await self._end_stream(self.response)

    async def _fail(self, error: OpenAIError) -> web.StreamResponse:
        logger.warning("%s: the stream ends with an error: %s", self.model, error.message)
        if self.response is None:
            return error_response(error)
        failed(error.message)
        await self.response.write(error.to_sse().encode())
        return await self._end_stream(self.response)

    @staticmethod
    async def _end_stream(response: web.StreamResponse) -> web.StreamResponse:
        await response.write(f"data: {DONE}\n\n".encode())
        await response.write_eof()
        return response


async def _read_to_end(upstream: aiohttp.ClientResponse) -> None:
    """What a stream sends after its [DONE] (its end, normally), read and dropped, so that its connection
    can be reused; one that does not end soon is closed instead."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with asyncio.timeout(END_AFTER_DONE_S):
            while await upstream.content.readany():
                pass
