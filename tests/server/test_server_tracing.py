"""Request traces over OTLP (vLLM's --otlp-traces-endpoint), over gRPC and over HTTP, received by a collector
the test runs and read with OpenTelemetry's own protobuf definitions; the numbers checked against what the
openai SDK got."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from click.testing import CliRunner
from local_http import QuietHandler, serving
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from ports import free_port
from servers import ServerProcess

from kvfleet.cli import cli

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
# Spans leave in batches; the test's servers send theirs every 100 ms.
EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


class Collector:
    """What an OTLP trace collector received: each span with its resource's attributes."""

    def __init__(self) -> None:
        self._spans: list[tuple[dict[str, Any], Span]] = []
        self._lock = threading.Lock()
        # The resource attributes the spans must come with.
        self.expected_resource: dict[str, str] = {}

    def receive(self, body: bytes) -> bytes:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self._spans.extend((resource, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    def wait_for(self, request_id_prefix: str, timeout: float = 30.0) -> tuple[dict[str, Any], Span]:
        """The span of the request whose engine request id starts with the prefix."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for resource, span in self._spans:
                    if str(_attributes(span.attributes)["gen_ai.request.id"]).startswith(request_id_prefix):
                        return resource, span
            time.sleep(0.1)
        raise AssertionError(f"no span of {request_id_prefix} in {len(self._spans)} received")


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@contextlib.contextmanager
def grpc_collector(collector: Collector) -> Iterator[str]:
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
# What the spans come from: OpenTelemetry's settings (as the operator gives each InferenceService's pods), or
# kvfleet where none names the service.
RESOURCES = {
    "grpc": ({}, {"service.name": "kvfleet"}),
    "http/protobuf": (
        {"OTEL_SERVICE_NAME": "chat", "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=team-a"},
        {"service.name": "chat", "k8s.namespace.name": "team-a"},
    ),
}


@pytest.fixture(scope="module", params=list(COLLECTORS))
def traced(
    request: pytest.FixtureRequest, start_server: Callable[..., ServerProcess]
) -> Iterator[tuple[ServerProcess, Collector]]:
    collector = Collector()
    resource_env, collector.expected_resource = RESOURCES[request.param]
    with COLLECTORS[request.param](collector) as endpoint:
        env = {**EXPORT_ENV, **resource_env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": request.param}
        server = start_server("--otlp-traces-endpoint", endpoint, env=env)
        yield server, collector
        server.stop()


def _client(server: ServerProcess, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, default_headers=headers or {}
    )


def test_a_request_with_a_trace_context_is_a_span_of_that_trace(
    traced: tuple[ServerProcess, Collector],
) -> None:
    server, collector = traced
    client = _client(server, {"traceparent": TRACEPARENT})
    completion = client.completions.create(
        model=server.model_name, prompt="Once upon a time", max_tokens=6, temperature=0.5, top_p=0.9
    )
    resource, span = collector.wait_for(completion.id)
    attributes = _attributes(span.attributes)
    assert collector.expected_resource.items() <= resource.items()
    assert span.name == "llm_request" and span.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert completion.usage is not None
    assert attributes["gen_ai.usage.prompt_tokens"] == completion.usage.prompt_tokens
    assert attributes["gen_ai.usage.completion_tokens"] == completion.usage.completion_tokens == 6
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.response.model"] == server.model_name
    assert attributes["gen_ai.request.max_tokens"] == 6 and attributes["gen_ai.request.n"] == 1
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    queue = attributes["gen_ai.latency.time_in_queue"]
    first_token, e2e = attributes["gen_ai.latency.time_to_first_token"], attributes["gen_ai.latency.e2e"]
    assert 0 <= queue < first_token <= e2e
    prefill, decode = (attributes[f"gen_ai.latency.time_in_model_{part}"] for part in ("prefill", "decode"))
    assert prefill == pytest.approx(first_token - queue) and decode > 0
    assert attributes["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(e2e, abs=1e-3)
    assert abs(span.end_time_unix_nano / 1e9 - time.time()) < 60
    assert span.status.code == Status.StatusCode.STATUS_CODE_UNSET


def test_a_streamed_chat_without_a_trace_context_starts_a_trace(
    traced: tuple[ServerProcess, Collector],
) -> None:
    server, collector = traced
    stream = _client(server).chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    _, span = collector.wait_for(chunks[0].id)
    attributes = _attributes(span.attributes)
    assert span.parent_span_id == b"" and span.trace_id.hex() not in ("", TRACE_ID)
    assert attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens


def test_a_request_the_client_leaves_ends_its_span_as_aborted(
    traced: tuple[ServerProcess, Collector],
) -> None:
    server, collector = traced
    body = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as sse,
    ):
        first = next(line for line in sse.iter_lines() if line.startswith("data: "))
    _, span = collector.wait_for(json.loads(first.removeprefix("data: "))["id"])
    attributes = _attributes(span.attributes)
    assert attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert 0 < attributes["gen_ai.usage.completion_tokens"] < 2000
    assert span.status.code == Status.StatusCode.STATUS_CODE_ERROR


def test_a_protocol_the_exporters_do_not_speak_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    endpoint = f"http://127.0.0.1:{free_port()}"
    completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), "--otlp-traces-endpoint", endpoint])
    assert completed.exit_code == 2
    refusal = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL 'http/json' is not one of grpc, http/protobuf"
    assert "--otlp-traces-endpoint" in completed.output and refusal in completed.output
