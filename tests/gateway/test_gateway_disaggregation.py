"""Disaggregated prefill and decode through the real gateway: prefill and decode replicas on real loopback
sockets that record what reached them, the prefill ones answering with `kv_transfer_params` as the engine
does. What the decode replica must receive is computed from what the client sent and what the prefill
replica offered, never written out."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from click.testing import CliRunner
from gateway_harness import (
    WAIT_S,
    FakeReplica,
    as_streamed,
    model,
    pod,
    replica_pod,
    replicas,
    running_gateway,
    service,
    streamed_text,
    wait_until,
)
from kvfleet.contract.resume import DRAINING_CODE
from kvfleet.gateway.cli import _static_models, gateway_command
from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.flow import Fleet
from kvfleet.gateway.kube import model_configs
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.proxy import Gateway, UpstreamTimeouts
from kvfleet.gateway.routing import CACHE_CHUNK_CHARS, CHARS_PER_TOKEN

THRESHOLD = 32
# Far above the threshold, and whole chunks of the cache-aware model's (a sentence of 64 characters).
LONG = "The quarterly report of the northern region, in all its detail. " * 20
assert len(LONG) % CACHE_CHUNK_CHARS == 0
SHORT = "hi"
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def prefill_call(client_body: dict[str, Any]) -> dict[str, Any]:
    """What PD-DESIGN's protocol says the prefill replica receives for a client's body."""
    expected = {k: v for k, v in client_body.items() if k not in ("stream_options", "min_tokens")}
    expected |= {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in client_body:
        expected["max_completion_tokens"] = 1
    return expected


def sample(gateway: Gateway, name: str, **labels: str) -> float:
    return gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def in_flight(gateway: Gateway, name: str) -> list[int]:
    """The requests in flight on every replica of the model, decode then prefill."""
    pool = gateway.fleet.pools[name]
    prefill = pool.prefill.replicas if pool.prefill is not None else []
    return [replica.in_flight for replica in [*pool.replicas, *prefill]]


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(f"{url}{path}", json=body) as answer:
        return answer.status, await answer.read()


def test_a_long_prompt_is_prefilled_and_the_decode_replica_gets_the_clients_body_with_the_params() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", offers_kv=True), FakeReplica("d")) as (prefill, decode):
            config = model("m", decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD)
            async with running_gateway({"m": config}) as (gateway, _, url):
                chat = {
                    "model": "m",
                    "messages": [{"role": "user", "content": LONG}],
                    "max_completion_tokens": 40,
                    "min_tokens": 5,
                    "temperature": 0,
                }
                status, answer = await post(url, "/v1/chat/completions", chat)
                assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == "d"
                assert prefill.received == [prefill_call(chat)]
                assert decode.received == [as_streamed({**chat, "kv_transfer_params": prefill.offers[0]})]
                # Both replicas name the request alike (their answers' ids, their logs).
                sent = [
                    value
                    for headers in (prefill.headers[0], decode.headers[0])
                    for name, value in headers.items()
                    if name.lower() == "x-request-id"
                ]
                assert len(sent) == 2 and sent[0] == sent[1], sent

                # Streamed: the prefill call is not, and the decode replica's stream reaches the client.
                streamed = {
                    "model": "m",
                    "messages": [{"role": "user", "content": LONG + "?"}],
                    "max_tokens": 30,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                stream = await client(url).chat.completions.create(**streamed)
                assert await streamed_text(stream) == "d"
                assert prefill.received[1] == prefill_call(streamed)
                assert decode.received[1] == as_streamed(
                    {**streamed, "kv_transfer_params": prefill.offers[1]}
                )

                assert in_flight(gateway, "m") == [0, 0]
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="disaggregated") == 2
                )
                assert sample(gateway, "kvfleet_gateway_pd_prefill_duration_seconds_count", model="m") == 2
                listed = await client(url).models.list()
                assert [entry.id for entry in listed.data] == ["m"]

    asyncio.run(scenario())


def test_prompts_with_few_new_tokens_on_their_decode_replica_skip_the_prefill_replicas() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", offers_kv=True), FakeReplica("d")) as (prefill, decode):
            config = model(
                "m", decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD, policy="cache-aware"
            )
            async with running_gateway({"m": config}) as (gateway, _, url):
                follow_up = LONG + "And the southern one?"
                # Each prompt's new characters as the gateway estimates them, and whether it prefills them.
                cases = [
                    (SHORT, len(SHORT), False),
                    (LONG, len(LONG), True),
                    # The decode replica holds LONG now: only the question is new there.
                    (follow_up, len(follow_up) - len(LONG), False),
                    ("Another document entirely. " * 20, len("Another document entirely. ") * 20, True),
                ]
                for prompt, new_chars, prefilled in cases:
                    assert (new_chars / CHARS_PER_TOKEN >= THRESHOLD) == prefilled
                    sent = len(prefill.received)
                    body = {"model": "m", "prompt": prompt, "max_tokens": 5}
                    assert (await post(url, "/v1/completions", body))[0] == 200
                    assert len(prefill.received) == sent + prefilled, prompt
                    params = {"kv_transfer_params": prefill.offers[-1]} if prefilled else {}
                    assert decode.received[-1] == as_streamed({**body, **params})
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="decode_only") == 2
                )
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="disaggregated") == 2
                )
                assert (
                    sample(gateway, "kvfleet_gateway_pd_prefill_fallbacks_total", model="m", reason="busy")
                    == 0
                )

    asyncio.run(scenario())


# The metric's reason for each way a prefill replica fails: a replica that answers so, or a URL.
def test_requests_of_several_sequences_are_prefilled_by_their_decode_replica() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", offers_kv=True), FakeReplica("d")) as (prefill, decode):
            config = model("m", decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD)
            async with running_gateway({"m": config}) as (gateway, _, url):
                several = [
                    {"model": "m", "prompt": LONG, "max_tokens": 5, "n": 2},
                    {"model": "m", "prompt": [LONG, LONG + "?"], "max_tokens": 5},
                    {"model": "m", "prompt": [[1, 2, 3] * 100, [4, 5, 6] * 100], "max_tokens": 5},
                ]
                for body in several:
                    assert (await post(url, "/v1/completions", body))[0] == 200
                assert prefill.received == [] and decode.received == [as_streamed(body) for body in several]
                one = {"model": "m", "prompt": [LONG], "max_tokens": 5, "n": 1}
                assert (await post(url, "/v1/completions", one))[0] == 200
                assert prefill.received == [prefill_call(one)]
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="decode_only") == 3
                )

    asyncio.run(scenario())


FAILURES: dict[str, Callable[[], FakeReplica | str]] = {
    "unreachable": lambda: DEAD,
    "error_status": lambda: FakeReplica("p", status=500),
    "timeout": lambda: FakeReplica("p", offers_kv=True, gated=True),
    "no_params": lambda: FakeReplica("p"),
}
PREFILL_TIMEOUT_S = 0.5
# The prefill timeout met on a loaded 2-core machine; a gateway without it waits for the first-byte timeout.
FELL_BACK_WITHIN_S = 10.0


@pytest.mark.parametrize("reason", sorted(FAILURES))
def test_a_failed_prefill_sends_the_request_to_its_decode_replica_without_params(reason: str) -> None:
    async def scenario() -> None:
        failing = FAILURES[reason]()
        fakes = [FakeReplica("d")] + ([failing] if isinstance(failing, FakeReplica) else [])
        async with replicas(*fakes) as started:
            decode = started[0]
            prefill = failing if isinstance(failing, str) else started[1]
            config = model("m", decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD)
            timeouts = UpstreamTimeouts(prefill=PREFILL_TIMEOUT_S)
            async with running_gateway({"m": config}, upstream_timeouts=timeouts) as (gateway, _, url):
                chat = {"model": "m", "messages": [{"role": "user", "content": LONG}], "stream": True}
                began = time.monotonic()
                stream = await client(url).chat.completions.create(**chat)
                assert await streamed_text(stream) == "d"
                assert time.monotonic() - began < FELL_BACK_WITHIN_S
                assert decode.received == [as_streamed(chat)], (
                    "the client's own body: the decode replica prefills it"
                )
                if isinstance(prefill, FakeReplica):
                    assert prefill.received == [prefill_call(chat)]
                if reason == "timeout":
                    await asyncio.wait_for(failing.disconnected.wait(), WAIT_S)
                assert (
                    sample(gateway, "kvfleet_gateway_pd_prefill_fallbacks_total", model="m", reason=reason)
                    == 1
                )
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="decode_only") == 1
                )
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="disaggregated") == 0
                )
                assert in_flight(gateway, "m") == [0, 0]

    asyncio.run(scenario())


def test_a_draining_prefill_replica_is_passed_over_by_the_next_requests() -> None:
    async def scenario() -> None:
        draining = FakeReplica("p1", status=503, error_code=DRAINING_CODE)
        async with replicas(draining, FakeReplica("p2", offers_kv=True), FakeReplica("d")) as (
            p1,
            p2,
            decode,
        ):
            config = model("m", decode, prefill=(p1, p2), pd_threshold_tokens=THRESHOLD)
            async with running_gateway({"m": config}) as (gateway, _, url):
                chat = {"model": "m", "messages": [{"role": "user", "content": LONG}], "stream": True}
                for _ in range(3):
                    stream = await client(url).chat.completions.create(**chat)
                    assert await streamed_text(stream) == "d"
                # The first request found p1 draining and went to its decode replica as it was; the others
                # were prefilled by p2 alone, where taking turns would have sent the third to p1 again.
                assert len(p1.received) == 1 and len(p2.received) == 2
                assert (
                    sample(gateway, "kvfleet_gateway_pd_requests_total", model="m", path="disaggregated") == 2
                )

    asyncio.run(scenario())


def test_a_prefill_replicas_4xx_is_the_clients_answer() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", status=400), FakeReplica("d")) as (prefill, decode):
            config = model("m", decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD)
            async with running_gateway({"m": config}) as (gateway, _, url):
                body = {"model": "m", "prompt": LONG, "max_tokens": 5}
                status, answer = await post(url, "/v1/completions", body)
                assert status == 400 and json.loads(answer)["error"]["message"] == "busy"
                assert len(prefill.received) == 1 and decode.received == []
                assert in_flight(gateway, "m") == [0, 0]
                assert sample(gateway, "kvfleet_gateway_requests_total", model="m", status="400") == 1

    asyncio.run(scenario())


def test_with_every_prefill_replica_full_a_request_is_prefilled_by_its_decode_replica() -> None:
    async def scenario() -> None:
        async with replicas(
            FakeReplica("p", offers_kv=True, gated=True), FakeReplica("d1"), FakeReplica("d2")
        ) as (prefill, d1, d2):
            config = model("m", d1, d2, prefill=(prefill,), pd_threshold_tokens=THRESHOLD, max_in_flight=1)
            async with running_gateway({"m": config}) as (gateway, _, url):
                body = {"model": "m", "prompt": LONG, "max_tokens": 5}
                first = asyncio.create_task(post(url, "/v1/completions", body))
                await wait_until(lambda: len(prefill.received) == 1)
                # The first request holds its decode replica and the prefill replica while it is prefilled.
                assert sorted(in_flight(gateway, "m")) == [0, 1, 1]
                second = {**body, "prompt": LONG + "again"}
                assert (await post(url, "/v1/completions", second))[0] == 200
                assert (
                    sample(gateway, "kvfleet_gateway_pd_prefill_fallbacks_total", model="m", reason="busy")
                    == 1
                )
                prefill.permits.release()
                assert (await asyncio.wait_for(first, WAIT_S))[0] == 200
                received = d1.received + d2.received
                assert sorted(received, key=len) == sorted(
                    [as_streamed(second), as_streamed({**body, "kv_transfer_params": prefill.offers[0]})],
                    key=len,
                )
                assert in_flight(gateway, "m") == [0, 0, 0]

    asyncio.run(scenario())


def test_a_client_that_leaves_during_the_prefill_frees_both_replicas() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", offers_kv=True, gated=True), FakeReplica("d")) as (
            prefill,
            decode,
        ):
            config = model("m", decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD)
            async with running_gateway({"m": config}) as (gateway, _, url):
                host, port = url.removeprefix("http://").split(":")
                _, writer = await asyncio.open_connection(host, int(port))
                body = json.dumps({"model": "m", "prompt": LONG, "max_tokens": 5}).encode()
                head = "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                await wait_until(lambda: len(prefill.received) == 1)
                assert in_flight(gateway, "m") == [1, 1]
                writer.close()  # the client goes away while its prompt is prefilled
                await asyncio.wait_for(prefill.disconnected.wait(), WAIT_S)
                await wait_until(lambda: in_flight(gateway, "m") == [0, 0])
                assert decode.received == []

    asyncio.run(scenario())


def test_a_decode_replica_that_refuses_the_connection_is_retried_with_the_same_params() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", offers_kv=True), FakeReplica("d")) as (prefill, decode):
            config = model(
                "m", DEAD, decode, prefill=(prefill,), pd_threshold_tokens=THRESHOLD, policy="round-robin"
            )
            async with running_gateway({"m": config}) as (gateway, _, url):
                body = {"model": "m", "prompt": LONG, "max_tokens": 5}
                assert (await post(url, "/v1/completions", body))[0] == 200
                assert len(prefill.received) == 1, "prefilled once"
                assert decode.received == [as_streamed({**body, "kv_transfer_params": prefill.offers[0]})]
                assert (
                    sample(gateway, "kvfleet_gateway_retries_total", model="m", reason="connection_error")
                    == 1
                )
                assert in_flight(gateway, "m") == [0, 0, 0]

    asyncio.run(scenario())


def test_pods_labelled_with_a_role_are_the_models_prefill_and_decode_replicas() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("p", offers_kv=True), FakeReplica("d"), FakeReplica("plain")) as (
            prefill,
            decode,
            plain,
        ):
            pods = [
                replica_pod("split", prefill, "default", role="prefill"),
                replica_pod("split", decode, "default", role="decode"),
                pod("split", "10.0.0.9", role="encode"),  # a role this gateway does not know: not routed
                replica_pod("whole", plain, "default"),
            ]
            defaults = ModelConfig(name="", endpoints=(), pd_threshold_tokens=THRESHOLD)
            models = model_configs([service("split"), service("whole")], pods, defaults)
            assert (models["default/split"].endpoints, models["default/split"].prefill_endpoints) == (
                (decode.url,),
                (prefill.url,),
            )
            assert (models["default/whole"].endpoints, models["default/whole"].prefill_endpoints) == (
                (plain.url,),
                (),
            )
            async with running_gateway(models) as (gateway, _, url):
                for name in ("default/split", "default/whole"):
                    body = {"model": name, "prompt": LONG, "max_tokens": 5}
                    assert (await post(url, "/v1/completions", body))[0] == 200
                split = {
                    "model": "split",
                    "prompt": LONG,
                    "max_tokens": 5,
                    "kv_transfer_params": prefill.offers[0],
                }
                assert decode.received == [as_streamed(split)]
                assert plain.received == [as_streamed({"model": "whole", "prompt": LONG, "max_tokens": 5})]
                assert gateway.fleet.pools["default/whole"].prefill is None

    asyncio.run(scenario())


def test_an_adapter_is_prefilled_only_by_prefill_replicas_that_serve_it() -> None:
    fleet = Fleet(16, GatewayMetrics())
    prefill = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    decode = ("http://10.0.0.3:8000",)
    fleet.update({"m": ModelConfig(name="m", endpoints=decode, prefill_endpoints=prefill)})
    assert fleet.replica_urls() == sorted(prefill + decode), "every role's adapters are polled"
    fleet.update_adapters({decode[0]: {"sql": 7}, prefill[1]: {"sql": 7, "other": None}})
    sql = fleet.pools["sql"].config
    assert (sql.endpoints, sql.prefill_endpoints) == (decode, (prefill[1],))
    assert "other" not in fleet.pools, "an adapter no decode replica serves is not routed"


def test_the_command_line_names_one_models_prefill_and_decode_replicas() -> None:
    defaults = ModelConfig(name="", endpoints=())
    models = _static_models(
        ("plain=http://a:8000", "split"),
        defaults,
        prefill=("http://p1:8000/", "http://p2:8000"),
        decode=("http://d1:8000",),
    )
    assert (models["plain"].endpoints, models["plain"].prefill_endpoints) == (("http://a:8000",), ())
    assert (models["split"].endpoints, models["split"].prefill_endpoints) == (
        ("http://d1:8000",),
        ("http://p1:8000", "http://p2:8000"),
    )
    for arguments in (
        ["--prefill", "http://p:8000", "--decode", "http://d:8000"],  # no model named
        ["--model", "split", "--prefill", "http://p:8000"],  # no decode replica
        ["--model", "a", "--model", "b", "--decode", "http://d:8000"],  # which one?
        ["--model", "split", "--decode", "http://d:8000", "--prefill", "p:8000"],  # not a URL
    ):
        result = CliRunner().invoke(gateway_command, arguments)
        assert result.exit_code == 2, (arguments, result.output)
