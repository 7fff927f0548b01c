"""The gateway's request traces over OpenTelemetry (`--otlp-traces-endpoint`, as a replica takes it): a span
for each request it routes, a child of the client's W3C trace context and the parent of the replicas' spans.

The span says what the gateway did with the request: the model and InferenceService it resolved to, the wait
for a replica with room, each replica it was sent to (prefill, decode, a stream's continuation), each retry
and broken stream with the reason, and the status it answered with. The replicas are sent the span's own
`traceparent` in place of the client's, so the engine's `llm_request` span nests under it; with tracing off
the client's trace context reaches them unchanged.

Code deeper in the gateway reads the request's span as OpenTelemetry's current span (`note` below): a
request's handler runs in its own context, and without tracing that span records nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from aiohttp import web
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_PROPAGATOR = TraceContextTextMapPropagator()


class GatewayTracing:
    """The gateway's tracer: a span for each request, exported in batches to an OTLP collector."""

    def __init__(self, endpoint: str) -> None:
        # The SDK and its exporters, only in a gateway that traces.
        from kvfleet.runtime.tracing import tracer_provider

        self._provider = tracer_provider(endpoint, "kvfleet-gateway")
        self._tracer = self._provider.get_tracer("kvfleet.gateway")

    @contextlib.contextmanager
    def request_span(self, request: web.Request) -> Iterator[Span]:
        """The request's span, current while the request is served (its stream relayed included); an
        exception ends it as failed, and so does a request cancelled before its end (its client left)."""
        # aiohttp's headers are case-insensitive: the client's trace context, whatever its case.
        carrier = {name: request.headers[name] for name in _TRACE_HEADERS if name in request.headers}
        parent = _PROPAGATOR.extract(carrier)
        with self._tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        ) as span:
            try:
                yield span
            except asyncio.CancelledError:
                span.set_status(Status(StatusCode.ERROR, "cancelled: the client left or the gateway stopped"))
                raise

    def shutdown(self) -> None:
        """Exports what is left (a few seconds at most) and stops the exporter."""
        self._provider.shutdown()


@contextlib.contextmanager
def untraced(request: web.Request) -> Iterator[Span]:
    """A span that records nothing, for a gateway without tracing."""
    yield INVALID_SPAN


def answered(span: Span, status: int) -> None:
    """The response's status on the request's span: a failure where the gateway or its replicas failed."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))


def note(event: str, **attributes: Any) -> None:
    """An event on the current request's span, its attributes named `kvfleet.<name>`."""
    get_current_span().add_event(event, {f"kvfleet.{name}": value for name, value in attributes.items()})


def describe(**attributes: Any) -> None:
    """Attributes of the current request's span, named `kvfleet.<name>`."""
    get_current_span().set_attributes({f"kvfleet.{name}": value for name, value in attributes.items()})


def failed(detail: str) -> None:
    """The current request failed after its response began (a stream ended with an error frame)."""
    get_current_span().set_status(Status(StatusCode.ERROR, detail))


def with_trace_context(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` for a replica: the current span's trace context in place of the client's where the request
    is traced, unchanged where it is not."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    if not carrier:
        return list(headers)
    return [(name, value) for name, value in headers if name.lower() not in _TRACE_HEADERS] + list(
        carrier.items()
    )
