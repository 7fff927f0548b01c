"""Request traces over OTLP (vLLM's --otlp-traces-endpoint), over gRPC and over HTTP, received by a collector
the test runs and read with OpenTelemetry's own protobuf definitions; the numbers checked against what the
openai SDK got. Through the fleet gateway, its span is the parent of the replica's."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import openai
import pytest
from click.testing import CliRunner
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from otlp_collector import COLLECTORS, EXPORT_ENV, Collector, attributes_of
from ports import free_port
from servers import ServerProcess

from kvfleet.cli import cli

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
# What the spans come from: OpenTelemetry's settings (as the operator gives each InferenceService's pods), or
# kvfleet where none names the service.
RESOURCES = {
    "grpc": ({}, {"service.name": "kvfleet"}),
    "http/protobuf": (
        {"OTEL_SERVICE_NAME": "chat", "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=team-a"},
        {"service.name": "chat", "k8s.namespace.name": "team-a"},
    ),
}


class Traced(NamedTuple):
    """A server exporting its spans to `collector` at `endpoint` over `protocol`, from `resource`."""

    server: ServerProcess
    collector: Collector
    endpoint: str
    protocol: str
    resource: dict[str, str]


@pytest.fixture(scope="module", params=list(COLLECTORS))
def traced(request: pytest.FixtureRequest, start_server: Callable[..., ServerProcess]) -> Iterator[Traced]:
    collector = Collector()
    resource_env, resource = RESOURCES[request.param]
    with COLLECTORS[request.param](collector) as endpoint:
        env = {**EXPORT_ENV, **resource_env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": request.param}
        server = start_server("--otlp-traces-endpoint", endpoint, env=env)
        yield Traced(server, collector, endpoint, request.param, resource)
        server.stop()


def _client(url: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers=headers or {})


def test_a_request_with_a_trace_context_is_a_span_of_that_trace(
    traced: Traced,
) -> None:
    server, collector = traced.server, traced.collector
    client = _client(server.url, {"traceparent": TRACEPARENT})
    completion = client.completions.create(
        model=server.model_name, prompt="Once upon a time", max_tokens=6, temperature=0.5, top_p=0.9
    )
    resource, span = collector.wait_for_request(completion.id)
    attributes = attributes_of(span.attributes)
    assert traced.resource.items() <= resource.items()
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
    traced: Traced,
) -> None:
    server, collector = traced.server, traced.collector
    stream = _client(server.url).chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    _, span = collector.wait_for_request(chunks[0].id)
    attributes = attributes_of(span.attributes)
    assert span.parent_span_id == b"" and span.trace_id.hex() not in ("", TRACE_ID)
    assert attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens


def test_a_request_the_client_leaves_ends_its_span_as_aborted(
    traced: Traced,
) -> None:
    server, collector = traced.server, traced.collector
    body = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as sse,
    ):
        first = next(line for line in sse.iter_lines() if line.startswith("data: "))
    _, span = collector.wait_for_request(json.loads(first.removeprefix("data: "))["id"])
    attributes = attributes_of(span.attributes)
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


@contextlib.contextmanager
def gateway_in_front(traced: Traced, log_path: Path) -> Iterator[str]:
    """A `kvfleet gateway` process routing the model to the traced server and exporting its spans to the same
    collector; stopped by its PID on exit, which exports what it holds."""
    port = free_port()
    env = {**os.environ, **EXPORT_ENV, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": traced.protocol}
    model = f"{traced.server.model_name}={traced.server.url}"
    command = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--model", model]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvfleet", *command, "--otlp-traces-endpoint", traced.endpoint],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _listening(url):
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the gateway did not start listening"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _listening(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


def test_through_the_gateway_its_span_is_the_parent_of_the_replicas(traced: Traced, tmp_path: Path) -> None:
    server, collector = traced.server, traced.collector
    with gateway_in_front(traced, tmp_path / "gateway.log") as url:
        completion = _client(url, {"traceparent": TRACEPARENT}).completions.create(
            model=server.model_name, prompt="Once upon a time", max_tokens=4
        )
    _, replica_span = collector.wait_for_request(completion.id)
    resource, gateway_span = collector.wait_for(lambda span: span.span_id == replica_span.parent_span_id)
    assert resource["service.name"] == "kvfleet-gateway"
    assert gateway_span.name == "POST /v1/completions" and gateway_span.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert gateway_span.trace_id.hex() == TRACE_ID and gateway_span.parent_span_id.hex() == PARENT_SPAN_ID
    assert replica_span.trace_id == gateway_span.trace_id
    attributes = attributes_of(gateway_span.attributes)
    assert attributes["gen_ai.request.model"] == attributes["kvfleet.model"] == server.model_name
    assert attributes["http.request.method"] == "POST" and attributes["url.path"] == "/v1/completions"
    assert attributes["http.response.status_code"] == 200 and attributes["kvfleet.queue_wait_s"] >= 0
    assert [(event.name, attributes_of(event.attributes)) for event in gateway_span.events] == [
        ("replica", {"kvfleet.url": server.url, "kvfleet.role": "decode"})
    ]
    # The gateway's span holds the replica's (both stamped from the same machine's clock).
    assert gateway_span.start_time_unix_nano <= replica_span.start_time_unix_nano + 1_000_000
    assert gateway_span.end_time_unix_nano >= replica_span.end_time_unix_nano - 1_000_000
    assert gateway_span.status.code == Status.StatusCode.STATUS_CODE_UNSET
