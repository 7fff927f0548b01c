"""An OTLP trace collector for tests, over gRPC or HTTP on loopback: what the servers and the gateway export,
read back with OpenTelemetry's own protobuf definitions."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from local_http import QuietHandler, serving
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

# Spans leave in batches; a process started with these settings sends its spans every 100 ms.
EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


class Collector:
    """What an OTLP trace collector received: each span with its resource's attributes."""

    def __init__(self) -> None:
        self._spans: list[tuple[dict[str, Any], Span]] = []
        self._lock = threading.Lock()

    def receive(self, body: bytes) -> bytes:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self._spans.extend((resource, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    def wait_for(self, matches: Callable[[Span], bool], timeout: float = 30.0) -> tuple[dict[str, Any], Span]:
        """The first span received that `matches`, with its resource's attributes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for resource, span in self._spans:
                    if matches(span):
                        return resource, span
            time.sleep(0.1)
        raise AssertionError(f"no such span in the {len(self._spans)} received")

    def wait_for_request(self, request_id_prefix: str) -> tuple[dict[str, Any], Span]:
        """The engine's span of the request whose engine request id starts with the prefix."""
        return self.wait_for(
            lambda span: str(attributes_of(span.attributes).get("gen_ai.request.id")).startswith(
                request_id_prefix
            )
        )


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind)


def attributes_of(pairs: Any) -> dict[str, Any]:
    """A span's, an event's or a resource's attributes as a dict."""
    return {pair.key: _value(pair.value) for pair in pairs}


@contextlib.contextmanager
def grpc_collector(collector: Collector) -> Iterator[str]:
    """The endpoint of a gRPC OTLP receiver feeding `collector`."""

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            return trace_service_pb2.ExportTraceServiceResponse.FromString(
                collector.receive(request.SerializeToString())
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def http_collector(collector: Collector) -> Iterator[str]:
    """The endpoint of an HTTP (protobuf) OTLP receiver feeding `collector`."""

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            answer = collector.receive(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    with serving(Handler) as port:
        yield f"http://127.0.0.1:{port}/v1/traces"


COLLECTORS = {"grpc": grpc_collector, "http/protobuf": http_collector}
