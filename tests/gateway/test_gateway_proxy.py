"""The gateway proxy end to end: the official openai SDK (or raw HTTP) -> the real gateway -> replicas on
real sockets."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import openai
import pytest
from gateway_harness import (
    WAIT_S,
    FakeReplica,
    as_streamed,
    leave_mid_stream,
    model,
    queued,
    replica_pod,
    replicas,
    running_gateway,
    service,
    wait_until,
)
from kvfleet.gateway.discovery import ClientKey, ModelConfig
from kvfleet.gateway.kube import model_configs

CHAT = [{"role": "user", "content": "hello"}]


def client(url: str, api_key: str = "unused", **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, **options)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text page (0 when absent)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            series, value = line.rsplit(" ", 1)
            found = ",".join(sorted(series[len(name) + 1 : -1].split(",")))
            if found == wanted:
                return float(value)
    return 0.0


async def page(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return await response.text()


def test_requests_reach_their_model_and_models_lists_the_fleet() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("a1"), FakeReplica("a2"), FakeReplica("b1")) as (a1, a2, b1):
            models = {"alpha": model("alpha", a1, a2), "beta": model("beta", b1)}
            async with running_gateway(models) as (_, _, url):
                sdk = client(url)
                listed = await sdk.models.list()
                assert sorted(entry.id for entry in listed.data) == ["alpha", "beta"]
                for _ in range(4):
                    chat = await sdk.chat.completions.create(model="alpha", messages=CHAT)
                    assert chat.choices[0].message.content in {"a1", "a2"}
                text = await sdk.completions.create(model="beta", prompt="hi")
                assert text.choices[0].text == "b1"
                assert len(a1.received) + len(a2.received) == 4 and len(b1.received) == 1
                assert all(body["model"] == "alpha" for body in a1.received + a2.received)

    asyncio.run(scenario())


def test_the_body_and_headers_reach_the_replica_unchanged_but_for_the_stream_asked() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}) as (_, _, url),
        ):
            body = {"model": "m", "messages": CHAT, "max_tokens": 3, "priority": "high", "extra": [1, 2]}
            async with aiohttp.ClientSession() as session:
                traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                headers = {"Authorization": "Bearer secret", "x-kvfleet-priority": "batch"}
                headers["traceparent"] = traceparent
                async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as answer:
                    assert answer.status == 200
                    assert answer.headers["x-replica"] == "r"
            assert replica.received == [as_streamed(body)]
            assert replica.headers[0]["Authorization"] == "Bearer secret"
            assert replica.headers[0]["x-kvfleet-priority"] == "batch"
            # A gateway without tracing passes the client's trace context on as it came.
            assert replica.headers[0]["traceparent"] == traceparent

    asyncio.run(scenario())


def test_an_unknown_model_is_404_without_an_upstream_call() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}) as (_, _, url),
        ):
            with pytest.raises(openai.NotFoundError) as raised:
                await client(url).chat.completions.create(model="other", messages=CHAT)
            assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]
            assert raised.value.body["param"] == "model"  # type: ignore[index]
            assert replica.received == []

    asyncio.run(scenario())


MALFORMED = [
    ("/v1/chat/completions", b"{not json", {}),
    ("/v1/chat/completions", b"[1, 2]", {}),
    ("/v1/chat/completions", json.dumps({"messages": CHAT}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": "", "messages": CHAT}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": "hi"}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": CHAT, "stream": "yes"}).encode(), {}),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": CHAT, "priority": "urgent"}).encode(), {}),
    (
        "/v1/chat/completions",
        json.dumps({"model": "m", "messages": CHAT}).encode(),
        {"x-kvfleet-priority": "9"},
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": "m", "messages": CHAT}).encode(),
        {"x-kvfleet-deadline-ms": "0"},
    ),
    ("/v1/completions", json.dumps({"model": "m"}).encode(), {}),
    ("/v1/completions", json.dumps({"model": "m", "prompt": {"text": "x"}}).encode(), {}),
    ("/v1/completions", b"\xff\xfe", {}),
    # JSON past the nesting limit: thousands deep was a 500 (RecursionError), hundreds deep was forwarded.
    ("/v1/completions", b'{"model": "m", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "user": ' + b"[" * 300 + b"]" * 300 + b"}", {}),
]


@pytest.mark.parametrize(("path", "body", "headers"), MALFORMED)
def test_a_malformed_body_is_refused_before_routing(path: str, body: bytes, headers: dict[str, str]) -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}) as (_, _, url),
            aiohttp.ClientSession() as session,
        ):
            headers["Content-Type"] = "application/json"
            async with session.post(f"{url}{path}", data=body, headers=headers) as answer:
                assert answer.status == 400
                error = (await answer.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["message"]
            assert replica.received == []

    asyncio.run(scenario())


def test_bodies_and_headers_are_bounded() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}, max_body_bytes=4096) as (_, _, url),
            aiohttp.ClientSession() as session,
        ):
            big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
            async with session.post(f"{url}/v1/chat/completions", json=big) as answer:
                assert answer.status == 413
                assert (await answer.json())["error"]["type"] == "invalid_request_error"
            small = {"model": "m", "messages": CHAT}
            huge_header = {"x-filler": "y" * 20_000}
            async with session.post(f"{url}/v1/chat/completions", json=small, headers=huge_header) as answer:
                assert 400 <= answer.status < 500
            assert replica.received == []

    asyncio.run(scenario())


def test_server_sent_events_pass_through_unbuffered() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r", pause_after_first_chunk=True)) as (replica,),
            running_gateway({"m": model("m", replica)}) as (_, _, url),
        ):
            stream = await client(url).chat.completions.create(model="m", messages=CHAT, stream=True)
            chunks = aiter(stream)
            # The replica holds its second chunk back: the first arrives only if nothing buffers it.
            first = await asyncio.wait_for(anext(chunks), WAIT_S)
            assert first.choices[0].delta.role == "assistant"
            replica.resume.set()
            rest = [chunk.choices[0].delta.content async for chunk in chunks]
            assert rest == ["r", None]

    asyncio.run(scenario())


def test_a_client_disconnect_reaches_the_replica() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r", pause_after_first_chunk=True)) as (replica,),
            running_gateway({"m": model("m", replica)}) as (gateway, _, url),
            aiohttp.ClientSession() as session,
        ):
            await leave_mid_stream(session, url, replica)
            pool = gateway.fleet.pools["m"]
            await wait_until(lambda: pool.replicas[0].in_flight == 0)

    asyncio.run(scenario())


def test_connection_errors_and_503s_are_retried_on_another_replica() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("busy", status=503), FakeReplica("good")) as (busy, good):
            dead = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
            config = model("m", dead, busy, good, policy="round-robin")
            async with running_gateway({"m": config}) as (_, _, url):
                sdk = client(url)
                for _ in range(6):
                    chat = await sdk.chat.completions.create(model="m", messages=CHAT)
                    assert chat.choices[0].message.content == "good"
                metrics = await page(url)
        assert len(good.received) == 6 and busy.received
        assert metric(metrics, "kvfleet_gateway_retries_total", model="m", reason="connection_error") >= 1
        assert metric(metrics, "kvfleet_gateway_retries_total", model="m", reason="unavailable") >= 1

    asyncio.run(scenario())


def test_a_stream_that_breaks_after_its_first_byte_is_resumed_on_another_replica() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("a", die_after_first_chunk=True), FakeReplica("b")) as (
            broken,
            other,
        ):
            config = model("m", broken, other, policy="round-robin")
            async with running_gateway({"m": config}) as (_, _, url), aiohttp.ClientSession() as session:
                body = {"model": "m", "messages": CHAT, "stream": True}
                async with session.post(f"{url}/v1/chat/completions", json=body) as answer:
                    assert answer.status == 200
                    events = (await answer.read()).decode().split("\n\n")
                chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
                assert [chunk["choices"][0]["delta"] for chunk in chunks] == [
                    {"role": "assistant", "content": ""},
                    {"content": "b"},
                    {},
                ]
                assert {chunk["id"] for chunk in chunks} == {"chatcmpl-a"} and events[-2] == "data: [DONE]"
                continuation = {"choices": [{"index": 0, "token_ids": [], "finished": False}]}
                assert other.received == [{**as_streamed(body), "continuation": continuation}]

    asyncio.run(scenario())


def test_a_model_with_no_usable_replica_is_503_with_retry_after_once_the_hold_time_passes() -> None:
    async def scenario() -> None:
        dead = "http://127.0.0.1:9"
        models = {"zero": model("zero", hold_seconds=0.2), "down": model("down", dead, hold_seconds=0.2)}
        async with running_gateway(models) as (_, _, url):
            sdk = client(url)
            for name in models:
                with pytest.raises(openai.APIStatusError) as raised:
                    await sdk.chat.completions.create(model=name, messages=CHAT)
                assert raised.value.status_code == 503
                assert int(raised.value.response.headers["Retry-After"]) > 0
                assert raised.value.body["type"] == "service_unavailable"  # type: ignore[index]

    asyncio.run(scenario())


def test_a_request_for_a_model_at_zero_is_held_until_a_replica_is_ready() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("late")) as (late,),
            running_gateway({"m": model("m", hold_seconds=WAIT_S)}) as (gateway, discovery, url),
        ):
            request = asyncio.create_task(client(url).chat.completions.create(model="m", messages=CHAT))
            await wait_until(lambda: queued(gateway, "m") == 1)
            assert not request.done()
            discovery.publish({"m": model("m", late, hold_seconds=WAIT_S)})
            chat = await asyncio.wait_for(request, WAIT_S)
            assert chat.choices[0].message.content == "late"
            metrics = await page(url)
        assert metric(metrics, "kvfleet_gateway_activation_seconds_count", model="m") == 1
        assert metric(metrics, "kvfleet_gateway_queue_depth", model="m") == 0

    asyncio.run(scenario())


def test_a_service_key_is_checked_before_the_request_is_queued_or_wakes_anything() -> None:
    key = ClientKey(hashlib.sha256(b"tenant-key").digest())

    async def scenario() -> None:
        async with replicas(FakeReplica("r1")) as (r1,):
            models = {
                "keyed": model("keyed", r1, client_key=key),
                "asleep": model("asleep", client_key=key, hold_seconds=30),
                "unreadable": model("unreadable", r1, client_key=ClientKey(None)),
            }
            async with running_gateway(models) as (gateway, _, url):
                for api_key in ("unused", "tenant-key-but-longer"):
                    with pytest.raises(openai.AuthenticationError) as refused:
                        await client(url, api_key=api_key).chat.completions.create(
                            model="keyed", messages=CHAT
                        )
                    assert refused.value.code == "invalid_api_key"
                assert r1.received == [], "refused before any replica saw it"
                chat = await client(url, api_key="tenant-key").chat.completions.create(
                    model="keyed", messages=CHAT
                )
                assert chat.choices[0].message.content == "r1"
                # A model at zero: a wrong key is refused at once, not held while a replica would start.
                with pytest.raises(openai.AuthenticationError):
                    await client(url, timeout=5).completions.create(model="asleep", prompt="wake up")
                assert queued(gateway, "asleep") == 0
                with pytest.raises(openai.APIStatusError) as unavailable:
                    await client(url, api_key="tenant-key").completions.create(model="unreadable", prompt="x")
                assert unavailable.value.status_code == 503
                assert "cannot read the API key" in unavailable.value.message

    asyncio.run(scenario())


def digest(key: bytes) -> ClientKey:
    return ClientKey(hashlib.sha256(key).digest())


def llama_8b_in_two_namespaces(
    *, prod: FakeReplica | None = None, other: FakeReplica | None = None
) -> dict[str, ModelConfig]:
    """As the Kubernetes discovery publishes them: team-prod/llama with its key, and aaa/x, created later
    but first by namespace, with none, both serving `llama-8b`; team-b/llama with a key of its own."""
    served = {"uri": "hf://org/model", "servedName": "llama-8b"}
    services = [
        service("llama", "team-prod", "2026-01-01T00:00:00Z", model=served, engine={"apiKeySecret": "key"}),
        service("x", "aaa", "2026-02-01T00:00:00Z", model=served),
        service("llama", "team-b", "2026-01-01T00:00:00Z", model=served, engine={"apiKeySecret": "key"}),
    ]
    pods = []
    if prod is not None:
        pods.append(replica_pod("llama", prod, "team-prod"))
    if other is not None:
        pods.append(replica_pod("x", other, "aaa"))
    keys = {("team-prod", "key"): digest(b"prod-key"), ("team-b", "key"): digest(b"b-key")}
    return model_configs(services, pods, ModelConfig(name="", endpoints=()), keys)


def test_a_namespace_serving_the_same_name_takes_neither_the_traffic_nor_the_keys_of_another() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("prod"), FakeReplica("other")) as (prod, other):
            models = llama_8b_in_two_namespaces(prod=prod, other=other)
            async with running_gateway(models) as (_, _, url):
                tenant = client(url, api_key="prod-key")
                # The attack: the bare name, which aaa/x serves too, with team-prod's key.
                with pytest.raises(openai.NotFoundError):
                    await tenant.chat.completions.create(model="llama-8b", messages=CHAT)
                assert other.received == [], "without a bare-name namespace, no bare name is routed"
                chat = await tenant.chat.completions.create(model="team-prod/llama-8b", messages=CHAT)
                assert chat.choices[0].message.content == "prod"
                assert prod.received[0]["model"] == "llama-8b", "the replica gets the name it serves"
                assert prod.headers[0]["Authorization"] == "Bearer prod-key"
                with pytest.raises(openai.AuthenticationError):
                    await client(url, api_key="b-key").chat.completions.create(
                        model="team-prod/llama-8b", messages=CHAT
                    )
                # aaa's service needs no key, and gets none: the caller's key is not meant for it.
                text = await tenant.completions.create(model="aaa/llama-8b", prompt="hi")
                assert text.choices[0].text == "other"
                assert "Authorization" not in other.headers[0]
                # Nor as x-api-key, as Anthropic's clients may send it.
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        f"{url}/v1/completions",
                        json={"model": "aaa/llama-8b", "prompt": "hi"},
                        headers={"x-api-key": "prod-key"},
                    ) as answer,
                ):
                    assert answer.status == 200
                assert "x-api-key" not in {name.lower() for name in other.headers[1]}
                assert len(prod.received) == 1 and len(other.received) == 2

    asyncio.run(scenario())


def test_a_bare_name_reaches_the_bare_name_namespace_only() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("prod"), FakeReplica("other")) as (prod, other):
            models = llama_8b_in_two_namespaces(prod=prod, other=other)
            async with running_gateway(models, bare_name_namespace="team-prod") as (_, _, url):
                chat = await client(url, api_key="prod-key").chat.completions.create(
                    model="llama-8b", messages=CHAT
                )
                assert chat.choices[0].message.content == "prod" and other.received == []
                with pytest.raises(openai.NotFoundError):
                    await client(url).completions.create(model="open-model", prompt="hi")
                metrics = await page(url)
        assert (
            metric(metrics, "kvfleet_gateway_requests_total", model="team-prod/llama-8b", status="200") == 1
        )

    asyncio.run(scenario())


def test_models_lists_only_what_the_callers_key_may_use() -> None:
    async def scenario() -> None:
        async with running_gateway(llama_8b_in_two_namespaces()) as (_, _, url):
            for api_key, listed in (
                ("prod-key", ["aaa/llama-8b", "team-prod/llama-8b"]),
                ("b-key", ["aaa/llama-8b", "team-b/llama-8b"]),
                ("unknown", ["aaa/llama-8b"]),
            ):
                models = await client(url, api_key=api_key).models.list()
                assert [entry.id for entry in models.data] == listed, api_key

    asyncio.run(scenario())
