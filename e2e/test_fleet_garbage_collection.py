"""Deleting an InferenceService removes every child through the garbage collector: the owner references
the operator sets are what the real controller manager follows."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from e2e.cluster import LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import API_VERSION, KIND, fake_gpu_service, service_selector, services_path
from e2e.fleet.observe import service_pods, wait_ready
from e2e.support.waits import wait_for

# Every kind the operator makes for a service, and the ReplicaSets and pods the controllers make from them.
CHILD_PATHS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "ReplicaSet": "/apis/apps/v1/namespaces/{ns}/replicasets",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "Pod": "/api/v1/namespaces/{ns}/pods",
}


def children(cluster: LocalCluster, namespace: str, name: str) -> dict[str, list[dict]]:
    selector = service_selector(name)
    return {
        kind: cluster.api.get(path.format(ns=namespace), labelSelector=selector)["items"]
        for kind, path in CHILD_PATHS.items()
    }


@pytest.mark.parametrize("cascade", ["background", "foreground"])
def test_deleting_the_service_removes_every_child(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    cascade: str,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    created = api.create(
        services_path(namespace), fake_gpu_service("doomed", gpus=1, scaling={"replicas": 2})
    )
    wait_ready(api, namespace, "doomed")
    wait_for("both replicas", lambda: len(service_pods(api, namespace, "doomed")) == 2)

    found = children(local_cluster, namespace, "doomed")
    assert {kind: len(items) for kind, items in found.items()} == {
        "Deployment": 1,
        "ReplicaSet": 1,
        "Service": 1,
        "PodDisruptionBudget": 1,
        "Pod": 2,
    }
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        (child,) = found[kind]
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": "doomed",
                "uid": created["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], kind

    started = time.monotonic()
    local_cluster.kubectl("delete", "inferenceservice", "doomed", "-n", namespace, f"--cascade={cascade}")

    def all_gone() -> bool:
        return not any(children(local_cluster, namespace, "doomed").values())

    wait_for("every child of the deleted service gone", all_gone, timeout=60, interval=0.2)
    measurements(
        f"{cascade} deletion: every child gone {time.monotonic() - started:.1f}s after kubectl delete"
    )
    assert api.get(services_path(namespace))["items"] == []
