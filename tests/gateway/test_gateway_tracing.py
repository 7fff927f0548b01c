"""The gateway's request spans, exported over OTLP to a collector the test runs and read with OpenTelemetry's
own protobuf definitions: what the gateway did with each request (its replicas, retries, a broken stream's
continuation, its answer), and the trace context the replicas were sent; and the X-Request-Id that names a
request at every replica and in its answer. The span's place between the client's and a real replica's is
tested with `kvfleet serve` (tests/server/test_server_tracing.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner
from gateway_harness import FakeReplica, leave_mid_stream, model, replicas, running_gateway
from kvfleet.gateway.cli import gateway_command
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from otlp_collector import Collector, attributes_of, grpc_collector

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
CHAT = [{"role": "user", "content": "hello"}]
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused


def events(span: Span) -> list[tuple[str, dict[str, Any]]]:
    return [(event.name, attributes_of(event.attributes)) for event in span.events]


def parent_sent(replica: FakeReplica, request: int = 0) -> tuple[str, str]:
    """The trace and parent span ids of the W3C traceparent a replica was sent with a request."""
    _, trace_id, span_id, _ = replica.headers[request]["traceparent"].split("-")
    return trace_id, span_id


def request_id_sent(replica: FakeReplica, first: int = 0) -> list[str]:
    """The X-Request-Id a replica was sent with each request from the `first` on."""
    return [
        value
        for sent in replica.headers[first:]
        for name, value in sent.items()
        if name.lower() == "x-request-id"
    ]


def ids(span: Span) -> tuple[str, str]:
    return span.trace_id.hex(), span.span_id.hex()


async def chat(url: str, model_name: str, headers: dict[str, str], stream: bool = False) -> tuple[int, bytes]:
    body = {"model": model_name, "messages": CHAT, "stream": stream}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.read()


def test_a_span_names_each_replica_tried_and_why_and_the_replica_is_sent_its_trace_context() -> None:
    collector = Collector()

    async def scenario(endpoint: str) -> None:
        async with replicas(FakeReplica("busy", status=503), FakeReplica("good")) as (busy, good):
            config = model("m", DEAD, busy, good, policy="round-robin", default_priority=7)
            async with running_gateway({"m": config}, otlp_traces_endpoint=endpoint) as (_, _, url):
                assert (await chat(url, "m", {"traceparent": TRACEPARENT}))[0] == 200
        _, span = collector.wait_for(lambda span: span.trace_id.hex() == TRACE_ID)
        assert span.name == "POST /v1/chat/completions" and span.kind == Span.SpanKind.SPAN_KIND_SERVER
        assert span.parent_span_id.hex() == PARENT_SPAN_ID
        assert events(span) == [
            ("replica", {"kvfleet.url": DEAD, "kvfleet.role": "decode"}),
            ("retry", {"kvfleet.url": DEAD, "kvfleet.reason": "connection_error"}),
            ("replica", {"kvfleet.url": busy.url, "kvfleet.role": "decode"}),
            ("retry", {"kvfleet.url": busy.url, "kvfleet.reason": "unavailable"}),
            ("replica", {"kvfleet.url": good.url, "kvfleet.role": "decode"}),
        ]
        attributes = attributes_of(span.attributes)
        assert attributes["kvfleet.model"] == "m" and attributes["kvfleet.routing_policy"] == "round-robin"
        assert attributes["kvfleet.priority"] == 7 and attributes["http.response.status_code"] == 200
        assert span.status.code == Status.StatusCode.STATUS_CODE_UNSET
        # Each replica was sent the gateway's span as the parent of its own, not the client's.
        assert parent_sent(busy) == parent_sent(good) == ids(span)

    with grpc_collector(collector) as endpoint:
        asyncio.run(scenario(endpoint))


def test_one_x_request_id_names_a_request_at_each_replica_it_reaches_and_in_its_answer() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("busy", status=503), FakeReplica("good")) as (busy, good):
            config = model("m", busy, good, policy="round-robin")
            async with running_gateway({"m": config}) as (_, _, url), aiohttp.ClientSession() as session:

                async def answer_id(name: str, **headers: str) -> str:
                    body = {"model": name, "messages": CHAT, "stream": True}
                    async with session.post(
                        f"{url}/v1/chat/completions", json=body, headers=headers
                    ) as answer:
                        await answer.read()
                        return answer.headers["X-Request-Id"]

                # None sent: one is made, and the replica that refused and the one that answered got it.
                made = await answer_id("m")
                assert len(made) == 32 and int(made, 16) >= 0
                assert request_id_sent(busy) == request_id_sent(good) == [made]
                # The client's own, to every replica and back; on an answer of the gateway's own too.
                assert await answer_id("m", **{"X-Request-Id": "trace-9"}) == "trace-9"
                assert {*request_id_sent(busy, 1), *request_id_sent(good, 1)} == {"trace-9"}
                assert await answer_id("no-such-model", **{"x-request-id": "trace-10"}) == "trace-10"
                # One that cannot name a request (kvfleet.contract.request_ids) is passed over for a new one.
                remade = await answer_id("m", **{"X-Request-Id": "two words"})
                assert len(remade) == 32 and remade in request_id_sent(busy) + request_id_sent(good)

    asyncio.run(scenario())


def test_a_broken_stream_and_its_continuation_are_events_of_one_span() -> None:
    collector = Collector()

    async def scenario(endpoint: str) -> None:
        fleet = FakeReplica("a", die_after_first_chunk=True), FakeReplica("b")
        async with replicas(*fleet) as (broken, other):
            config = model("m", broken, other, policy="round-robin")
            async with running_gateway({"m": config}, otlp_traces_endpoint=endpoint) as (_, _, url):
                status, answer = await chat(url, "m", {}, stream=True)
                assert status == 200 and answer.endswith(b"data: [DONE]\n\n")
        _, span = collector.wait_for(lambda span: span.name == "POST /v1/chat/completions")
        assert span.parent_span_id == b"", "without the client's trace context the span starts a trace"
        assert events(span) == [
            ("replica", {"kvfleet.url": broken.url, "kvfleet.role": "decode"}),
            ("stream_broke", {"kvfleet.url": broken.url, "kvfleet.cause": "reset"}),
            ("replica", {"kvfleet.url": other.url, "kvfleet.role": "continuation"}),
        ]
        assert parent_sent(other) == ids(span)
        assert span.status.code == Status.StatusCode.STATUS_CODE_UNSET

    with grpc_collector(collector) as endpoint:
        asyncio.run(scenario(endpoint))


def test_a_refused_request_is_a_span_with_its_status_and_a_gateway_failure_an_error() -> None:
    collector = Collector()

    async def scenario(endpoint: str) -> None:
        down = model("down", DEAD, hold_seconds=0.2)
        async with running_gateway({"down": down}, otlp_traces_endpoint=endpoint) as (_, _, url):
            assert (await chat(url, "nope", {}))[0] == 404
            assert (await chat(url, "down", {}))[0] == 503
        spans = {}
        for name in ("nope", "down"):
            _, spans[name] = collector.wait_for(
                lambda span, name=name: attributes_of(span.attributes)["gen_ai.request.model"] == name
            )
        assert attributes_of(spans["nope"].attributes)["http.response.status_code"] == 404
        assert spans["nope"].status.code == Status.StatusCode.STATUS_CODE_UNSET and not spans["nope"].events
        assert attributes_of(spans["down"].attributes)["http.response.status_code"] == 503
        assert spans["down"].status.code == Status.StatusCode.STATUS_CODE_ERROR

    with grpc_collector(collector) as endpoint:
        asyncio.run(scenario(endpoint))


def test_a_stream_its_client_leaves_ends_its_span_as_failed() -> None:
    collector = Collector()

    async def scenario(endpoint: str) -> None:
        async with (
            replicas(FakeReplica("r", pause_after_first_chunk=True)) as (replica,),
            running_gateway({"m": model("m", replica)}, otlp_traces_endpoint=endpoint) as (_, _, url),
            aiohttp.ClientSession() as session,
        ):
            await leave_mid_stream(session, url, replica)
        _, span = collector.wait_for(lambda span: span.name == "POST /v1/chat/completions")
        assert span.status.code == Status.StatusCode.STATUS_CODE_ERROR
        assert span.status.message == "cancelled: the client left or the gateway stopped"
        assert events(span) == [("replica", {"kvfleet.url": replica.url, "kvfleet.role": "decode"})]

    with grpc_collector(collector) as endpoint:
        asyncio.run(scenario(endpoint))


def test_a_protocol_the_exporters_do_not_speak_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    arguments = ["--model", "m=http://127.0.0.1:9", "--otlp-traces-endpoint", "http://127.0.0.1:9"]
    completed = CliRunner().invoke(gateway_command, arguments)
    assert completed.exit_code == 2
    refusal = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL 'http/json' is not one of grpc, http/protobuf"
    assert "--otlp-traces-endpoint" in completed.output and refusal in completed.output
