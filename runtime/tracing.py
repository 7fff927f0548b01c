"""Request traces over OpenTelemetry (vLLM's `--otlp-traces-endpoint`): a span for each engine request, named
`llm_request` and with the attributes vLLM gives it (OpenTelemetry's gen_ai names), exported over OTLP.

Its parent is whatever trace context is current when the request reaches the engine: the API server makes
the caller's W3C trace context (the `traceparent` and `tracestate` headers, which a fleet gateway passes on)
current for the HTTP request, so the engine's span joins the caller's trace without the engine reading HTTP.

The exporter's protocol is OpenTelemetry's own setting, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc (the
default, as in vLLM) or http/protobuf; the exporter reads its other OTEL_EXPORTER_OTLP_TRACES_* settings
(headers, certificates, insecure) itself, and the spans' resource is OTEL_SERVICE_NAME's and
OTEL_RESOURCE_ATTRIBUTES'. Spans leave in batches off the event loop, on the SDK's thread. The fleet gateway
exports its own spans the same way (`tracer_provider`, kvfleet.gateway.tracing).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.request import FAILED_FINISH_REASONS
from opentelemetry import context as otel_context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from kvfleet.runtime.engine.outputs import RequestMetrics
    from kvfleet.runtime.sampling_params import SamplingParams

_SPAN_NAME = "llm_request"
# Spans in one export at most, unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE says: a batch is encoded on the SDK's
# thread holding the GIL, and the SDK's 512 held a gateway's event loop for some 25 ms at 200 requests a
# second (a p99 24 to 28 ms over the untraced gateway's, against 4 ms with 64; docs/benchmarks.md).
_MAX_EXPORT_BATCH = 64
_PROTOCOLS = ("grpc", "http/protobuf")


class RequestTracing:
    """The API server's tracer: starts a span for each engine request and exports the ended ones."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        self._provider = tracer_provider(endpoint, "kvfleet")
        self._tracer = self._provider.get_tracer("kvfleet.runtime")
        self._model_name = model_name

    def start(self, request_id: str, params: SamplingParams, arrival_s: float) -> RequestSpan:
        """The span of a request that arrived at `arrival_s` (time.monotonic()), child of the current trace
        context."""
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": self._model_name,
            "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.top_k > 0:
            attributes["gen_ai.request.top_k"] = params.top_k
        span = self._tracer.start_span(
            _SPAN_NAME,
            context=otel_context.get_current(),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=_epoch_ns(arrival_s),
        )
        return RequestSpan(span)

    def shutdown(self) -> None:
        """Exports what is left (a few seconds at most) and stops the exporter."""
        self._provider.shutdown()


class RequestSpan:
    """One request's span, ended once with what its outputs said."""

    def __init__(self, span: Span) -> None:
        self._span = span

    def end(
        self,
        finish_reasons: Sequence[str],
        times: RequestMetrics | None,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        span = self._span
        span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))
        span.set_attribute("gen_ai.usage.prompt_tokens", prompt_tokens)
        span.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
        finished = time.monotonic()
        if times is not None:
            finished = times.finished_time or finished
            for name, seconds in _latencies(times, finished).items():
                span.set_attribute(name, seconds)
        # Not an answer: the span's status says the request failed.
        if FAILED_FINISH_REASONS & set(finish_reasons):
            span.set_status(Status(StatusCode.ERROR, ", ".join(finish_reasons)))
        span.end(end_time=_epoch_ns(finished))


def tracer_provider(endpoint: str, service_name: str) -> TracerProvider:
    """Spans exported in batches to the OTLP collector at `endpoint` (see the module's doc), from a resource
    whose service is `service_name` where OpenTelemetry's settings name none; which requests are traced is
    OpenTelemetry's OTEL_TRACES_SAMPLER's (all by default, or the caller's choice where it has a parent)."""
    provider = TracerProvider(resource=_resource(service_name))
    batch = None if "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in os.environ else _MAX_EXPORT_BATCH
    provider.add_span_processor(BatchSpanProcessor(_span_exporter(endpoint), max_export_batch_size=batch))
    return provider


def _resource(service_name: str) -> Resource:
    """What the spans come from: OpenTelemetry's OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES where set
    (the operator names each InferenceService and its namespace), `service_name` where they name no
    service."""
    detected = Resource.create()
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return detected.merge(Resource({SERVICE_NAME: service_name}))
    return detected


def traces_protocol() -> str:
    """The OTLP protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (grpc by default); ValueError naming the
    setting for one the exporters do not speak."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in _PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r} is not one of {', '.join(_PROTOCOLS)}"
        )
    return protocol


def _span_exporter(endpoint: str) -> SpanExporter:
    if traces_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint)


def _latencies(times: RequestMetrics, finished: float) -> dict[str, float]:
    """vLLM's latency attributes, in seconds, for the events the request reached."""
    latencies = {"gen_ai.latency.e2e": finished - times.arrival_time}
    scheduled, first, last = times.first_scheduled_time, times.first_token_time, times.last_token_time
    if scheduled is not None:
        latencies["gen_ai.latency.time_in_queue"] = scheduled - times.arrival_time
    if first is not None:
        latencies["gen_ai.latency.time_to_first_token"] = first - times.arrival_time
    if scheduled is not None and first is not None:
        latencies["gen_ai.latency.time_in_model_prefill"] = first - scheduled
    if first is not None and last is not None:
        latencies["gen_ai.latency.time_in_model_decode"] = last - first
    if scheduled is not None and last is not None:
        latencies["gen_ai.latency.time_in_model_inference"] = last - scheduled
    return latencies


def _epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() moment as the nanoseconds since the epoch that spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
