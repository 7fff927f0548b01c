"""aiohttp's server connections, with the time limits the runtime's have (runtime/server/http_protocol.py).

- Headers: from a connection's opening, and from the end of each response on it, the client has
  `header_read_timeout` seconds to send the next request's headers whole. Partial headers then get a 408;
  an idle keep-alive connection is closed. (aiohttp's own keep-alive clock, an hour by default, would close
  either without a word.)
- Sending: when a client stops reading, the socket's buffers fill and the transport pauses writing. If it
  stays paused for `send_timeout` seconds, the connection is dropped with whatever it had buffered; the
  handler is cancelled, which closes the upstream connection, so the replica aborts the request and its
  place is freed.

The body's limit is the handler's (Gateway._body), which can still answer with a proper 408.

aiohttp builds one RequestHandler per connection and has no option for its class: TimedAppRunner hands
TCPSite a server that builds TimedRequestHandler instead, which also answers aiohttp's own errors (a request
it cannot parse, a handler that failed) in OpenAI's shape. The handler's state is read from aiohttp's own
attributes (pinned in requirements/gateway.txt), as the runtime reads uvicorn's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web, web_protocol
from kvfleet.contract.errors import header_timeout_response, http_error
from kvfleet.gateway.http_errors import error_response

logger = logging.getLogger(__name__)

# The runtime's defaults (kvfleet.runtime.server.state).
DEFAULT_HEADER_READ_TIMEOUT_S = 30.0
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_SEND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ClientTimeouts:
    """How long the gateway waits on its clients."""

    # The next request's headers, from the connection's opening or the previous response's end.
    header_read: float = DEFAULT_HEADER_READ_TIMEOUT_S
    # A request's whole body, from its headers.
    body_read: float = DEFAULT_BODY_READ_TIMEOUT_S
    # A response whose client has stopped reading.
    send: float = DEFAULT_SEND_TIMEOUT_S


DEFAULT_CLIENT_TIMEOUTS = ClientTimeouts()


_HEADER_TIMEOUT_RESPONSE = header_timeout_response()


class TimedRequestHandler(web_protocol.RequestHandler):
    def __init__(self, manager: web.Server, *, timeouts: ClientTimeouts, **options: Any) -> None:
        super().__init__(manager, **options)
        self._timeouts = timeouts
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        # Whether bytes of the next request's headers have arrived since its clock started.
        self._headers_begun = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._restart_header_clock()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_clock()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._serving():
            self._stop_header_clock()
        elif data:
            self._headers_begun = True

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        finished = await super().finish_response(request, resp, start_time)
        # Unless the connection ends here, or the next request has arrived whole already.
        if resp.keep_alive and not self._messages:
            self._restart_header_clock()
        return finished

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self._loop.call_later(self._timeouts.send, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it cannot parse (400, 431, ...) or whose handler failed (500), in
        OpenAI's shape. aiohttp logs it and raises, instead, when a response has begun already."""
        super().handle_error(request, status, exc, message)
        detail = "the gateway failed to handle the request" if status >= 500 else message or "bad request"
        response = error_response(http_error(status, detail))
        response.force_close()
        return response

    def _serving(self) -> bool:
        """A request's headers have arrived whole: it waits for its handler or is being handled."""
        return self._request_in_progress or bool(self._messages)

    def _restart_header_clock(self) -> None:
        self._stop_header_clock()
        self._headers_begun = False
        self._header_timer = self._loop.call_later(self._timeouts.header_read, self._headers_timed_out)

    def _stop_header_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport is None or self.transport.is_closing() or self._serving():
            return
        if self._headers_begun:
            logger.info("request headers incomplete after %g s; closing", self._timeouts.header_read)
            self.transport.write(_HEADER_TIMEOUT_RESPONSE)
        self.force_close()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        logger.warning("a client read nothing for %g s; dropping its connection", self._timeouts.send)
        if self.transport is not None:
            # abort(), not close(): close() would wait, for ever, to flush what the client does not read.
            self.transport.abort()


class _TimedServer(web.Server):
    def __init__(self, *args: Any, timeouts: ClientTimeouts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeouts = timeouts

    def __call__(self) -> TimedRequestHandler:
        return TimedRequestHandler(self, loop=self._loop, timeouts=self._timeouts, **self._kwargs)


class TimedAppRunner(web.AppRunner):
    """An AppRunner whose connections keep the client timeouts."""

    def __init__(self, app: web.Application, *, timeouts: ClientTimeouts, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._timeouts = timeouts

    async def _make_server(self) -> web.Server:
        built = await super()._make_server()
        return _TimedServer(
            built.request_handler,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            loop=built._loop,
            timeouts=self._timeouts,
            **built._kwargs,
        )
