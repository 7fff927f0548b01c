"""Plain ASGI middleware (not BaseHTTPMiddleware, which would hide the client's disconnect from handlers)."""

from __future__ import annotations

import asyncio
import uuid

from kvfleet.contract.errors import http_error
from kvfleet.contract.request_ids import REQUEST_ID_HEADER
from kvfleet.contract.tokenizer_files import TOKENIZER_FILES_PATH
from kvfleet.runtime.server.errors import PayloadTooLargeError, error_response, route_path
from kvfleet.runtime.server.state import ServerState
from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Probes and scrapes (the metrics, the tokenizer's files a router reads): open to any caller without a key,
# never counted as work in flight, never held back by a drain.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/ping", "/load", TOKENIZER_FILES_PATH})
# As ASGI's headers are keyed.
REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode()
# W3C Trace Context's headers.
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


class BodySizeLimit:
    """Refuses bodies over the limit with 413: at once when Content-Length says so, otherwise as soon as
    the bytes received pass it, so an endless chunked upload cannot tie up memory."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Paths with a limit of their own (file uploads).
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(route_path(scope), self.max_bytes)
        message = f"the request body is larger than the server's limit of {max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            response = error_response(PayloadTooLargeError(message, code="request_too_large"), scope)
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > max_bytes:
                    raise HTTPException(413, message)
            return event

        await self.app(scope, counting_receive, send)


class HeaderCountLimit:
    """vLLM's --h11-max-header-count: a request with more headers than the limit gets 431, and its connection
    is closed."""

    def __init__(self, app: ASGIApp, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        count = len(scope["headers"]) if scope["type"] == "http" else 0
        if count <= self.max_headers:
            await self.app(scope, receive, send)
            return
        message = f"the request has {count} headers, more than the server's limit of {self.max_headers}"
        response = error_response(http_error(431, message), scope)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


class BodyReadTimeout:
    """Gives a request's body `timeout` seconds to arrive whole, counted from when the app starts on the
    request; a client trickling it (slowloris) gets 408 and the connection is closed."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                # Past the body, receive() only waits for the client to leave, however long that takes.
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.timeout:g} s",
                    headers={"Connection": "close"},
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


class RequestIdHeader:
    """vLLM's X-Request-Id on every response: the request's own, or a new one, for tracing a request
    through proxies and logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(REQUEST_ID_KEY) or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_KEY]
                message = {**message, "headers": [*headers, (REQUEST_ID_KEY, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class TraceContext:
    """The caller's W3C trace context (its traceparent and tracestate headers) made the current one while its
    request runs, so that the engine's span of the request joins the caller's trace (kvfleet.runtime.tracing).
    A request without them starts a trace of its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in (scope["headers"] if scope["type"] == "http" else ())
            if name in TRACE_HEADERS
        }
        if not carrier:
            await self.app(scope, receive, send)
            return
        token = otel_context.attach(self.propagator.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


class InFlightCounter:
    """Counts requests that are not probes, from arrival until their response is fully sent: what a drain
    waits for."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
