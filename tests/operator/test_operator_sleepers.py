"""Sleeping replicas (spec.scaling.sleepingReplicas): kept started beside the awake ones, put to sleep when
idle and not wanted, woken when wanted again; and the spec's bounds on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from kvfleet.operator.adapters import ReplicaUnavailable
from kvfleet.operator.autoscaler import PodMetrics
from kvfleet.operator.observed import PodView
from kvfleet.operator.scrape import GatewayQueue, ScrapeTarget
from kvfleet.operator.sleepers import Sleepers, plan
from kvfleet.operator.spec import SpecError, parse_spec
from test_operator_controller import FOR_KVFLEET, Harness, deployment_at, service

IDLE = PodMetrics(waiting=0, running=0)
BUSY = PodMetrics(waiting=0, running=1)


def _pod(name: str, ready: bool = True) -> PodView:
    return PodView(name, f"127.1.0.{name[-1]}", ready, False)


@dataclass
class FakeSleep:
    """Replicas' sleep state by pod, as the runtime's API would report and change it."""

    asleep: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)
    calls: list[tuple[str, str, str | None]] = field(default_factory=list)

    async def is_sleeping(self, target: ScrapeTarget, api_key: str | None) -> bool:
        if target.pod in self.unreachable:
            raise ReplicaUnavailable(f"{target.pod}: /is_sleeping did not answer")
        return target.pod in self.asleep

    async def sleep(self, target: ScrapeTarget, api_key: str | None) -> None:
        self.calls.append(("sleep", target.pod, api_key))
        self.asleep.add(target.pod)

    async def wake_up(self, target: ScrapeTarget, api_key: str | None) -> None:
        self.calls.append(("wake_up", target.pod, api_key))
        if target.pod in self.unreachable:
            raise ReplicaUnavailable(f"{target.pod}: /wake_up did not answer")
        self.asleep.discard(target.pod)


def test_the_plan_wakes_what_is_missing_and_puts_only_idle_replicas_to_sleep() -> None:
    a, b, c = _pod("svc-1"), _pod("svc-2"), _pod("svc-3", ready=False)
    assert plan(2, [a], [c], {a: IDLE}, held=0).wake == (c,)
    assert plan(3, [a], [c], {a: IDLE}, held=0).wake == (c,), "no more sleepers than there are"
    assert plan(0, [a, b], [], {a: BUSY, b: IDLE}, held=0).sleep == (b,), "a busy replica stays awake"
    assert plan(1, [a, b], [], {a: IDLE, b: IDLE}, held=0).sleep == (a,)
    assert plan(0, [a], [], {a: None}, held=0).sleep == (), "no report: not known to be idle"
    for held in (1.0, None):
        assert plan(0, [a], [], {a: IDLE}, held=held).sleep == (), "requests held, or not known"


def _sleeping_service(**scaling: Any) -> dict[str, Any]:
    body = service(
        scaling={
            "minReplicas": 0,
            "sleepingReplicas": 1,
            "scaleToZeroAfterSeconds": 0,
            "scaleDownDelaySeconds": 0,
            **scaling,
        },
        model={"uri": "file:///models/tiny", "servedName": "m"},
        engine={"apiKeySecret": "key"},
    )
    return body


def test_a_replica_not_wanted_sleeps_instead_of_going_and_wakes_for_held_requests() -> None:
    harness = Harness(_sleeping_service())
    harness.cluster.secret_labels_by_name[("ns", "key")] = FOR_KVFLEET
    harness.cluster.secrets = {("ns", "key", "KVFLEET_API_KEY"): "secret"}
    replicas = FakeSleep()
    harness.controller.sleepers = Sleepers(replicas)
    held = {"ns/m": 0.0}

    async def gateway_queue(model: str) -> GatewayQueue | None:
        return GatewayQueue(held=held[model])

    harness.controller.gateway_queue = gateway_queue
    harness.run()
    args = harness.deployments()[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-sleep-mode" in args

    harness.scraper.per_pod = IDLE
    harness.clock.now += 2
    harness.run(deployment_at(1), [_pod("svc-1")])
    assert harness.cluster.statuses[-1]["desiredReplicas"] == 0, "idle: no replica is wanted awake"
    assert harness.deployments()[-1]["spec"]["replicas"] == 1, "the sleeping replica is kept"
    assert replicas.calls == [("sleep", "svc-1", "secret")]
    assert "ReplicaAsleep" in harness.reasons()

    asleep = [_pod("svc-1", ready=False)]
    harness.clock.now += 2
    harness.run(deployment_at(1, ready=0), asleep)
    assert replicas.calls == [("sleep", "svc-1", "secret")], "asleep already: nothing to do"
    held["ns/m"] = 1.0
    harness.clock.now += 2
    harness.run(deployment_at(1, ready=0), asleep)
    assert harness.cluster.statuses[-1]["desiredReplicas"] == 1
    assert harness.deployments()[-1]["spec"]["replicas"] == 1, "woken, not started anew"
    assert replicas.calls[-1] == ("wake_up", "svc-1", "secret") and not replicas.asleep
    assert "ReplicaWoken" in harness.reasons()


def test_more_replicas_wanted_than_sleep_are_started_beside_them() -> None:
    harness = Harness(_sleeping_service(sleepingReplicas=2, maxReplicas=4))
    harness.cluster.secret_labels_by_name[("ns", "key")] = FOR_KVFLEET
    replicas = FakeSleep(asleep={"svc-1", "svc-2"}, unreachable={"svc-2"})
    harness.controller.sleepers = Sleepers(replicas)

    async def gateway_queue(model: str) -> GatewayQueue | None:
        return GatewayQueue(held=12.0)

    harness.controller.gateway_queue = gateway_queue
    harness.controller.desired = 0
    sleeping = [_pod("svc-1", ready=False), _pod("svc-2", ready=False)]
    harness.run(deployment_at(2, ready=0), sleeping)
    wanted = harness.cluster.statuses[-1]["desiredReplicas"]
    assert wanted >= 1
    assert harness.deployments()[-1]["spec"]["replicas"] == max(wanted, 2)
    # svc-2 does not answer: not known to sleep, so not woken; svc-1 is.
    assert [call[:2] for call in replicas.calls] == [("wake_up", "svc-1")]


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"scaling": {"replicas": 2, "sleepingReplicas": 1}}, "needs the autoscaler"),
        ({"scaling": {"maxReplicas": 2, "sleepingReplicas": 3}}, "must not exceed"),
        (
            {
                "scaling": {"sleepingReplicas": 1},
                "engine": {"tensorParallelSize": 2},
                "resources": {"gpusPerNode": 1},
            },
            "one pod",
        ),
    ],
)
def test_the_spec_bounds_sleeping_replicas(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(SpecError, match=problem):
        parse_spec({"model": {"uri": "file:///models/tiny"}, **spec}, name="svc")
