"""Uvicorn's HTTP/1.1 (h11) connection handling, with the time limits it lacks.

- Headers: from a connection's opening, and from the end of each response on it, the client has
  `header_read_timeout` seconds to send the next request's headers whole. Without it, a client trickling
  header bytes (slowloris) holds a connection for ever. Partial headers get a 408, an idle connection is
  closed.
- Sending: when a client stops reading, the socket's buffers fill and the transport pauses writing. If it
  stays paused for `send_timeout` seconds, the connection is dropped with whatever it had buffered; the app
  sees a disconnect, so the request is aborted and its KV blocks are freed.

The body's limit is the app's (middleware.BodyReadTimeout), which can still answer with a proper 408.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

from kvfleet.contract.errors import header_timeout_response
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


_HEADER_TIMEOUT_RESPONSE = header_timeout_response()


class TimedH11Protocol(H11Protocol):
    header_read_timeout: ClassVar[float]
    send_timeout: ClassVar[float]

    _header_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeouts(cls, *, header_read_timeout: float, send_timeout: float) -> type[TimedH11Protocol]:
        """The protocol class to hand uvicorn (it builds one instance per connection)."""
        return type(
            cls.__name__, (cls,), {"header_read_timeout": header_read_timeout, "send_timeout": send_timeout}
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._send_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _watch_headers(self) -> None:
        """The header clock runs whenever no request is being served: before the first and between two."""
        serving = self.cycle is not None and not self.cycle.response_complete
        if serving or self.transport.is_closing():
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_read_timeout, self._headers_timed_out)

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        received, _ = self.conn.trailing_data
        if received:
            logger.info(
                "%s: request headers incomplete after %.0f s; closing", self._peer(), self.header_read_timeout
            )
            self.transport.write(_HEADER_TIMEOUT_RESPONSE)
        self.transport.close()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        logger.warning(
            "%s: the client read nothing for %.0f s; dropping the connection", self._peer(), self.send_timeout
        )
        # abort(), not close(): close() would wait, for ever, to flush what the client does not read.
        self.transport.abort()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"
