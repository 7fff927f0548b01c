"""Routing by LoRA adapter: the gateway learns from each replica which adapters it serves, routes an adapter's
requests only there, prefers the replicas already running it, and shares each replica's cap between its base
model and its adapters. First with the harness's replicas, then with real `kvfleet serve` processes through
the openai SDK."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from gateway_harness import (
    FakeReplica,
    model,
    queued,
    replica_pod,
    replicas,
    running_gateway,
    service,
    wait_until,
)
from kvfleet.gateway.adapters import adapter_ids
from kvfleet.gateway.discovery import ClientKey, ModelConfig
from kvfleet.gateway.flow import Fleet
from kvfleet.gateway.kube import model_configs
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.proxy import Gateway
from kvfleet.runtime.lora.make_adapter import make_adapter

if TYPE_CHECKING:
    from servers import ServerProcess

CHAT = [{"role": "user", "content": "hello"}]
POLL_S = 0.05


def client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def ready_replicas(gateway: Gateway, name: str) -> float:
    value = gateway.metrics.registry.get_sample_value("kvfleet_gateway_ready_replicas", {"model": name})
    return 0.0 if value is None else value


def test_adapters_and_their_lora_int_ids_are_read_from_a_metrics_page() -> None:
    """A replica that gives no lora_int_id (or one that is not a positive integer) serves the adapter all the
    same; the replicas' ids reach the routing policy on each replica."""
    page = """# HELP kvfleet:lora_adapter_info One series per LoRA adapter.
# TYPE kvfleet:lora_adapter_info gauge
kvfleet:lora_adapter_info{model_name="tiny",lora_name="sql",lora_int_id="81985529216486896"} 1.0
kvfleet:lora_adapter_info{lora_name="chat/v2",model_name="tiny"} 1.0
kvfleet:lora_adapter_info{lora_name="odd",lora_int_id="-3",model_name="tiny"} 1.0
# TYPE kvfleet:lora_requests counter
kvfleet:lora_requests_total{lora_name="old",model_name="tiny"} 3.0
"""
    ids = adapter_ids(page)
    assert ids == {"sql": 81985529216486896, "chat/v2": None, "odd": None}
    assert adapter_ids("# no adapters\n") == {}

    fleet = Fleet(8, GatewayMetrics())
    fleet.update({"m": ModelConfig(name="m", endpoints=("http://a", "http://b"))})
    fleet.update_adapters({"http://a": ids, "http://b": {"sql": 5}})
    by_url = {replica.url: replica for replica in fleet.pools["sql"].replicas}
    assert by_url["http://a"].lora_int_ids == {"sql": 81985529216486896}
    assert by_url["http://b"].lora_int_ids == {"sql": 5}
    assert set(fleet.pools["chat/v2"].replicas) == {by_url["http://a"]}


def test_an_adapter_routes_only_to_the_replicas_that_serve_it() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("a", adapters=["sql"]), FakeReplica("b")) as (a, b),
            running_gateway({"m": model("m", a, b)}, adapter_poll_seconds=POLL_S) as (gateway, _, url),
        ):
            await wait_until(lambda: "sql" in gateway.fleet.pools)
            sdk = client(url)
            listed = {entry.id: entry.model_extra for entry in (await sdk.models.list()).data}
            assert listed == {"m": {"parent": None}, "sql": {"parent": "m"}}
            for _ in range(4):
                reply = await sdk.chat.completions.create(model="sql", messages=CHAT)
                assert reply.choices[0].message.content == "a"
            with pytest.raises(openai.NotFoundError):
                await sdk.chat.completions.create(model="other", messages=CHAT)
            assert [body["model"] for body in a.received] == ["sql"] * 4 and b.received == []

            b.adapters = ["sql"]
            await wait_until(lambda: ready_replicas(gateway, "sql") == 2)
            for _ in range(4):
                await sdk.chat.completions.create(model="sql", messages=CHAT)
            assert len(a.received) == 6 and len(b.received) == 2

            a.adapters = b.adapters = []
            await wait_until(lambda: "sql" not in gateway.fleet.pools)
            with pytest.raises(openai.NotFoundError):
                await sdk.chat.completions.create(model="sql", messages=CHAT)

    asyncio.run(scenario())


def test_an_adapter_name_of_one_namespace_is_not_taken_by_a_replica_of_another() -> None:
    """aaa/x (first by namespace, no key) loads an adapter of the name team-prod's replicas serve: each
    namespace's adapter goes to its own replicas, with its own service's key."""

    async def scenario() -> None:
        async with replicas(
            FakeReplica("prod", adapters=["sql"]), FakeReplica("other", adapters=["sql"])
        ) as (
            prod,
            other,
        ):
            services = [
                service("llama", "team-prod", engine={"apiKeySecret": "key"}),
                service("x", "aaa"),
            ]
            pods = [replica_pod("llama", prod, "team-prod"), replica_pod("x", other, "aaa")]
            keys = {("team-prod", "key"): ClientKey(hashlib.sha256(b"prod-key").digest())}
            models = model_configs(services, pods, ModelConfig(name="", endpoints=()), keys)
            async with running_gateway(models, adapter_poll_seconds=POLL_S) as (gateway, _, url):
                await wait_until(lambda: {"team-prod/sql", "aaa/sql"} <= set(gateway.fleet.pools))
                tenant = client(url, api_key="prod-key")
                for _ in range(3):
                    reply = await tenant.chat.completions.create(model="team-prod/sql", messages=CHAT)
                    assert reply.choices[0].message.content == "prod"
                with pytest.raises(openai.NotFoundError):
                    await tenant.chat.completions.create(model="sql", messages=CHAT)
                reply = await tenant.chat.completions.create(model="aaa/sql", messages=CHAT)
                assert reply.choices[0].message.content == "other"
                assert [body["model"] for body in prod.received + other.received] == ["sql"] * 4
                assert len(other.received) == 1 and "Authorization" not in other.headers[0]

    asyncio.run(scenario())


def test_an_adapter_prefers_replicas_running_it_within_the_load_bound() -> None:
    async def scenario() -> None:
        async with replicas(
            FakeReplica("a", gated=True, adapters=["sql"]), FakeReplica("b", gated=True, adapters=["sql"])
        ) as (a, b):
            models = {"m": model("m", a, b, load_bound=1.25)}
            async with running_gateway(models, adapter_poll_seconds=POLL_S) as (gateway, _, url):
                await wait_until(lambda: ready_replicas(gateway, "sql") == 2)
                sdk = client(url)
                sent = []
                # The first request takes either replica; the second joins it there (1 of 2 allowed by the
                # bound, ceil(1.25 * 2 / 2)); the third would exceed the bound there and goes to the other.
                for count in (1, 2, 3):
                    sent.append(asyncio.create_task(sdk.chat.completions.create(model="sql", messages=CHAT)))
                    await wait_until(lambda count=count: len(a.received) + len(b.received) == count)
                first = a if a.received else b
                other = b if first is a else a
                assert len(first.received) == 2 and len(other.received) == 1
                for replica in (a, b):
                    for _ in replica.received:
                        replica.permits.release()
                await asyncio.gather(*sent)

    asyncio.run(scenario())


def test_a_replica_cap_counts_its_base_model_and_adapter_requests_together() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("a", gated=True, adapters=["sql"])) as (a,):
            models = {"m": model("m", a, max_in_flight=1)}
            async with running_gateway(models, adapter_poll_seconds=POLL_S) as (gateway, _, url):
                await wait_until(lambda: "sql" in gateway.fleet.pools)
                sdk = client(url)
                base = asyncio.create_task(sdk.chat.completions.create(model="m", messages=CHAT))
                await wait_until(lambda: len(a.received) == 1)
                adapter = asyncio.create_task(sdk.chat.completions.create(model="sql", messages=CHAT))
                await wait_until(lambda: queued(gateway, "sql") == 1)
                assert len(a.received) == 1
                # The base request's end frees the place the adapter's request waits for.
                a.permits.release()
                a.permits.release()
                await base
                await adapter
                assert [body["model"] for body in a.received] == ["m", "sql"]

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def sql_adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("adapters") / "sql", rank=8, seed=1)


def _lora_requests(server: ServerProcess, name: str) -> float:
    """What the replica itself counts of an adapter's requests."""
    prefix = f'kvfleet:lora_requests_total{{lora_name="{name}",model_name="{server.model_name}"}} '
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def _same_through_the_gateway(gateway: openai.AsyncOpenAI, replica: openai.AsyncOpenAI) -> None:
    """The rest of a replica's surface answers through the gateway as it does directly: the same embedding,
    and the same greedy text from the Responses API, streamed through the gateway."""
    text = "Once upon a time"
    via, direct = [
        (await sdk.embeddings.create(model="tiny", input=text, encoding_format="float")).data[0].embedding
        for sdk in (gateway, replica)
    ]
    assert via == pytest.approx(direct, abs=1e-5)
    options: dict[str, Any] = {"model": "tiny", "input": text, "max_output_tokens": 4, "temperature": 0.0}
    expected = (await replica.responses.create(**options)).output_text
    events = [event async for event in await gateway.responses.create(**options, stream=True)]
    assert events[-1].type == "response.completed"
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == expected and expected


@pytest.mark.slow
def test_real_replicas_serve_an_adapter_where_it_is_loaded(
    start_server: Callable[..., ServerProcess], sql_adapter: Path
) -> None:
    """Two `kvfleet serve` replicas behind an API key, the adapter on one: all its requests land there; once
    the other loads it too, both serve it, under the same lora_int_id. Their embeddings and the Responses API
    answer through the gateway as directly."""
    options = ("--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updates")
    # Both load at once: a start is mostly one process importing and loading, so two starts overlap.
    holder = start_server(*options, "--lora-modules", f"sql={sql_adapter}", api_key="fleet-key", wait=False)
    other = start_server(*options, api_key="fleet-key", wait=False)
    holder.wait_ready()
    other.wait_ready()
    fleet = {"tiny": model("tiny", holder.url, other.url)}

    async def complete(sdk: openai.AsyncOpenAI, **body: Any) -> str:
        reply = await sdk.completions.create(prompt="Once upon a time", max_tokens=3, temperature=0.0, **body)
        return reply.model

    async def scenario() -> None:
        async with running_gateway(fleet, adapter_poll_seconds=0.2) as (gateway, _, url):
            await wait_until(lambda: "sql" in gateway.fleet.pools)
            sdk = client(url, api_key="fleet-key")
            listed = {entry.id: entry.model_extra for entry in (await sdk.models.list()).data}
            assert listed == {"tiny": {"parent": None}, "sql": {"parent": "tiny"}}
            await _same_through_the_gateway(sdk, client(holder.url, api_key="fleet-key"))
            for _ in range(4):
                assert await complete(sdk, model="sql") == "sql"
            assert (_lora_requests(holder, "sql"), _lora_requests(other, "sql")) == (4, 0)
            with pytest.raises(openai.NotFoundError):
                await complete(sdk, model="nope")

            loaded = httpx.post(
                f"{other.url}/v1/load_lora_adapter",
                json={"lora_name": "sql", "lora_path": str(sql_adapter)},
                headers=other.headers(),
                timeout=60,
            )
            assert loaded.status_code == 200, loaded.text
            await wait_until(lambda: ready_replicas(gateway, "sql") == 2)
            # Two processes that loaded the same files give it one lora_int_id: its blocks hash alike.
            ids = [replica.lora_int_ids.get("sql") for replica in gateway.fleet.pools["sql"].replicas]
            assert len(ids) == 2 and ids[0] == ids[1] and isinstance(ids[0], int)
            for _ in range(4):
                assert await complete(sdk, model="sql") == "sql"
            assert _lora_requests(holder, "sql") > 4 and _lora_requests(other, "sql") > 0
            assert _lora_requests(holder, "sql") + _lora_requests(other, "sql") == 8

    asyncio.run(scenario())
