"""The chart's Argo CD health check (Lua, run with lupa as Argo CD runs it) on the live InferenceService at
each phase of its life: Progressing while the operator has not reported or has not seen a change, Healthy
when Ready, Degraded when its node is lost and no replica can be placed, Suspended when scaled to zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.cluster import KubeAPI, LocalCluster
from e2e.cluster.kube_api import MERGE_PATCH
from e2e.fleet.argocd import ArgoHealthCheck, Health
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import fake_gpu_service, services_path
from e2e.fleet.observe import service_pods

BROKEN_TAINT = {"key": "kvfleet.dev/e2e-node-lost", "value": "true", "effect": "NoExecute"}


class HealthTimeline:
    """Evaluates the health script on the live object until a status shows up; keeps what it saw."""

    def __init__(self, api: KubeAPI, namespace: str, name: str) -> None:
        self.api = api
        self.path = services_path(namespace, name)
        self.check = ArgoHealthCheck()
        self.seen: list[Health] = []

    def evaluate(self, obj: dict[str, Any]) -> Health:
        health = self.check.evaluate(obj)
        if not self.seen or self.seen[-1] != health:
            self.seen.append(health)
        return health

    def until(self, status: str, timeout: float = 60.0) -> Health:
        deadline = time.monotonic() + timeout
        while True:
            health = self.evaluate(self.api.get(self.path))
            if health.status == status:
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"no {status} within {timeout:.0f}s; health seen: {self.seen}")
            time.sleep(0.2)

    def statuses(self) -> list[str]:
        collapsed: list[str] = []
        for health in self.seen:
            if not collapsed or collapsed[-1] != health.status:
                collapsed.append(health.status)
        return collapsed


@pytest.fixture
def lost_node(local_cluster: LocalCluster) -> Iterator[dict[str, str]]:
    """Holds the name of a node to break (filled in by the test); its taint is always removed afterwards."""
    chosen: dict[str, str] = {}
    yield chosen
    if "name" in chosen:
        set_taints(local_cluster.api, chosen["name"], [])


def set_taints(api: KubeAPI, node: str, taints: list[dict[str, str]]) -> None:
    api.patch(f"/api/v1/nodes/{node}", {"spec": {"taints": taints or None}}, content_type=MERGE_PATCH)


def test_health_follows_the_live_object(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    lost_node: dict[str, str],
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    operator_node = kvfleet_release.operator_pod()["spec"]["nodeName"]
    node = next(
        n["metadata"]["name"]
        for n in api.get("/api/v1/nodes")["items"]
        if n["metadata"]["name"] != operator_node and not n["spec"].get("taints")
    )
    manifest = fake_gpu_service(
        "health", gpus=1, resources={"nodeSelector": {"kubernetes.io/hostname": node}}
    )
    timeline = HealthTimeline(api, namespace, "health")

    created = api.create(services_path(namespace), manifest)
    first = timeline.evaluate(created)
    assert first == Health("Progressing", "Waiting for the kvfleet operator to report")
    healthy = timeline.until("Healthy")
    assert healthy.message == "1 of 1 replicas ready"

    # A spec change is Progressing until the operator has seen its generation.
    changed = api.patch(
        services_path(namespace, "health"), {"spec": {"engine": {"maxNumSeqs": 64}}}, content_type=MERGE_PATCH
    )
    generation = changed["metadata"]["generation"]
    assert timeline.evaluate(changed) == Health(
        "Progressing", f"Waiting for the kvfleet operator to observe generation {generation}"
    )
    timeline.until("Healthy")

    # The node is lost: its pods are evicted (NoExecute) and the replacement fits nowhere else.
    lost_node["name"] = node
    set_taints(api, node, [BROKEN_TAINT])
    degraded = timeline.until("Degraded")
    assert "untolerated taint" in degraded.message and "1 replica(s) pending" in degraded.message
    assert all(pod["status"].get("phase") == "Pending" for pod in service_pods(api, namespace, "health"))

    set_taints(api, node, [])
    timeline.until("Healthy")

    api.patch(
        services_path(namespace, "health"), {"spec": {"scaling": {"replicas": 0}}}, content_type=MERGE_PATCH
    )
    suspended = timeline.until("Suspended")
    assert suspended.message == "spec.scaling.replicas is 0"

    statuses = timeline.statuses()
    measurements(f"Argo CD health over the object's life: {' -> '.join(statuses)}")
    assert statuses[:2] == ["Progressing", "Healthy"]
    # Changes pass through Progressing for as long as the operator takes to see them (if seen at all).
    settled = [status for status in statuses[1:] if status != "Progressing"]
    settled = [status for index, status in enumerate(settled) if index == 0 or settled[index - 1] != status]
    assert settled == ["Healthy", "Degraded", "Healthy", "Suspended"], timeline.seen
