"""Failures while the fleet works: the operator process killed in the middle of reconciling a batch of new
services (restarted by its pod's restart policy) leaves no duplicated or orphaned objects; a runtime pod
deleted under load is replaced and traffic recovers."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.cluster import KubeAPI, LocalCluster
from e2e.fleet.chart import OPERATOR_CONTAINER, OperatorRelease
from e2e.fleet.manifests import KIND, fake_gpu_service, service_selector, services_path, tiny_service
from e2e.fleet.observe import is_ready, service_pods, wait_ready
from e2e.fleet.traffic import ChatLoad, Outcome, ReadyEndpoints
from e2e.support.waits import condition, wait_for

SERVICES = [f"svc-{index}" for index in range(6)]
CHILD_KINDS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
}
# A restarted operator may wait out the peering record of the process that was killed (kopf: 60 s).
RECOVERY_BOUND_SECONDS = 120.0


def restart_count(release: OperatorRelease) -> int:
    statuses = release.operator_pod()["status"].get("containerStatuses", [])
    return next(s["restartCount"] for s in statuses if s["name"] == OPERATOR_CONTAINER)


def owned_children(api: KubeAPI, namespace: str) -> dict[str, list[dict[str, Any]]]:
    selector = "app.kubernetes.io/managed-by=kvfleet-operator"
    return {
        kind: api.get(path.format(ns=namespace), labelSelector=selector)["items"]
        for kind, path in CHILD_KINDS.items()
    }


def test_operator_killed_mid_reconcile_leaves_no_duplicates_or_orphans(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    restarts_before = restart_count(kvfleet_release)
    pid = kvfleet_release.operator_pid()
    assert pid is not None
    for name in SERVICES:
        api.create(services_path(namespace), fake_gpu_service(name, gpus=1))
    # Killed as a crash would: as soon as the first Deployment of the batch exists, the rest still to do.
    wait_for(
        "the first Deployment",
        lambda: api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments")["items"],
        30,
        0.02,
    )
    done_at_kill = len(api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments")["items"])
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    wait_for("the operator container restarted", lambda: restart_count(kvfleet_release) > restarts_before, 30)

    def all_ready() -> bool:
        return all(is_ready(service) for service in api.get(services_path(namespace))["items"])

    wait_for("every service Ready", all_ready, RECOVERY_BOUND_SECONDS, interval=0.5)
    measurements(
        f"operator killed with {done_at_kill} of {len(SERVICES)} Deployments applied; "
        f"every service Ready {time.monotonic() - killed:.1f}s later"
    )

    services = {s["metadata"]["name"]: s for s in api.get(services_path(namespace))["items"]}
    assert sorted(services) == SERVICES
    children = owned_children(api, namespace)
    for kind, items in children.items():
        assert sorted(item["metadata"]["name"] for item in items) == SERVICES, kind
        for item in items:
            owner = services[item["metadata"]["name"]]
            assert item["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": KIND,
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ], (kind, item["metadata"]["name"])
    for deployment in children["Deployment"]:
        # Applying again after the restart changed nothing: one template, one ReplicaSet, one pod.
        name = deployment["metadata"]["name"]
        assert deployment["metadata"]["generation"] == 1, name
        replica_sets = api.get(
            f"/apis/apps/v1/namespaces/{namespace}/replicasets", labelSelector=service_selector(name)
        )["items"]
        assert len(replica_sets) == 1, name
        assert len(service_pods(api, namespace, name)) == 1, name

    def operator_ready() -> bool:
        ready = condition(kvfleet_release.operator_pod(), "Ready")
        return ready is not None and ready["status"] == "True"

    # The restarted container passes its readiness probe again (the chart probes every 10 s).
    wait_for("the restarted operator Ready", operator_ready, 30)


def test_runtime_pod_deleted_under_load_is_replaced(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    api.create(services_path(namespace), tiny_service("resilient", tiny_model_dir))
    wait_ready(api, namespace, "resilient")
    (victim,) = service_pods(api, namespace, "resilient")
    victim_name = victim["metadata"]["name"]

    with (
        ReadyEndpoints(api, namespace, "resilient") as endpoints,
        ChatLoad(endpoints, 2, max_tokens=32) as load,
    ):
        wait_for("requests answered", lambda: len(load.successes()) >= 5, 30)
        deleted = time.monotonic()
        local_cluster.kubectl("delete", "pod", victim_name, "-n", namespace, "--wait=false")

        def first_replacement_answer() -> Outcome | None:
            answers = [o for o in load.successes() if o.pod != victim_name and o.started > deleted]
            return min(answers, key=lambda outcome: outcome.started, default=None)

        first = wait_for("the replacement answering", first_replacement_answer, 120, interval=0.2)
        wait_for(
            "more answers from the replacement",
            lambda: sum(o.pod == first.pod for o in load.successes()) >= 5,
            30,
        )

    after = [outcome for outcome in load.outcomes if outcome.started >= first.started]
    measurements(
        f"traffic recovered {first.finished - deleted:.1f}s after the pod was deleted "
        f"({load.seconds_without_endpoints:.1f} client-seconds without a serving pod, "
        f"{len(load.failures())} failed requests)"
    )
    assert len(after) >= 5 and all(outcome.error is None for outcome in after)
    assert all(outcome.started < first.started for outcome in load.failures())
    assert wait_ready(api, namespace, "resilient")["status"]["readyReplicas"] == 1
    # The deleted pod drained and its process stopped within its grace period.
    wait_for(
        "the deleted pod gone",
        lambda: (
            victim_name not in {pod["metadata"]["name"] for pod in service_pods(api, namespace, "resilient")}
        ),
        victim["spec"]["terminationGracePeriodSeconds"] + 5,
    )
