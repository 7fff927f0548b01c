"""A service that keeps replicas asleep (spec.scaling.sleepingReplicas): its started replicas that are not
ready are known to the gateway, and a request that finds no ready replica wakes one that sleeps and goes
there, before the kubelet's probe would have found it ready; a replica that answers that it sleeps is woken
for the request too."""

from __future__ import annotations

import asyncio

from gateway_harness import WAIT_S, FakeReplica, model, pod, queued, replicas, running_gateway, service
from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.kube import model_configs
from test_gateway_proxy import CHAT, client


def test_the_started_replicas_not_ready_of_a_service_with_sleepers_are_known() -> None:
    services = [
        service("warm", scaling={"minReplicas": 0, "sleepingReplicas": 1}),
        service("cold", scaling={"minReplicas": 0}, model={"uri": "hf://org/other"}),
    ]
    pods = [
        pod("warm", "10.0.0.1"),
        pod("warm", "10.0.0.2", ready=False),
        pod("warm", "10.0.0.3", ready=False, terminating=True),
        pod("cold", "10.0.0.4", ready=False),
    ]
    models = model_configs(services, pods, ModelConfig(name="", endpoints=()))
    warm, cold = models["default/warm"], models["default/cold"]
    assert warm.endpoints == ("http://10.0.0.1:8000",)
    assert warm.sleeping_endpoints == ("http://10.0.0.2:8000",)
    assert cold.endpoints == () and cold.sleeping_endpoints == (), "a service without sleepers has none"


def test_a_request_with_no_ready_replica_wakes_one_that_sleeps_and_goes_there() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("loading"), FakeReplica("sleepy", asleep=True)) as (loading, sleepy):
            sleepers = (loading.url, sleepy.url)
            config = model("m", hold_seconds=WAIT_S, sleeping_endpoints=sleepers)
            async with running_gateway({"m": config}) as (gateway, discovery, url):
                chat = await asyncio.wait_for(
                    client(url, api_key="the-key").chat.completions.create(model="m", messages=CHAT), WAIT_S
                )
                assert chat.choices[0].message.content == "sleepy"
                assert not sleepy.asleep and loading.wake_ups == [], "only the replica that sleeps is woken"
                assert sleepy.wake_ups[0]["Authorization"] == "Bearer the-key"
                assert queued(gateway, "m") == 0
                # Once the kubelet finds it ready, it is an endpoint as any other; it stays routed.
                discovery.publish({"m": model("m", sleepy, sleeping_endpoints=(loading.url,))})
                assert [r.url for r in gateway.fleet.pools["m"].replicas] == [sleepy.url]

    asyncio.run(scenario())


def test_a_replica_put_to_sleep_since_its_last_probe_is_woken_for_the_request_it_refuses() -> None:
    async def scenario() -> None:
        # Discovery still has it ready: the kubelet has not probed it since it fell asleep.
        async with (
            replicas(FakeReplica("dozing", asleep=True)) as (dozing,),
            running_gateway({"m": model("m", dozing, hold_seconds=WAIT_S)}) as (gateway, _, url),
        ):
            asked = client(url).chat.completions.create(model="m", messages=CHAT)
            chat = await asyncio.wait_for(asked, WAIT_S)
            assert chat.choices[0].message.content == "dozing"
            assert len(dozing.received) == 2 and len(dozing.wake_ups) == 1
            assert [r.url for r in gateway.fleet.pools["m"].replicas] == [dozing.url]

    asyncio.run(scenario())
