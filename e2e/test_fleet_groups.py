"""A model split over nodes on a real control plane: tensor parallel 2 with one GPU per node forms a group of
two pods (a StatefulSet), the service reports its ranks ready, a rank's pod deleted is replaced while the
group recovers, and a new template restarts the group's pods together.

The pods are kwok's (no process runs): what is tested is what Kubernetes and the operator do with the group,
not the runtime's collectives.
"""

from __future__ import annotations

from typing import Any

from e2e.cluster import GPU_RESOURCE, LocalCluster
from e2e.cluster.kube_api import MERGE_PATCH
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import (
    fake_gpu_service,
    one_node_per_pod,
    services_path,
    statefulset_path,
)
from e2e.fleet.observe import events_for, groups_whole, live_pods, wait_ready
from e2e.support.waits import wait_for

POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def test_tensor_parallel_over_two_nodes_forms_a_group_that_recovers_a_lost_rank(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    api = local_cluster.api
    manifest = fake_gpu_service(
        "split",
        engine={"tensorParallelSize": 2},
        resources={"gpus": None, "gpusPerNode": 1, "affinity": one_node_per_pod("split")},
    )
    api.create(services_path(namespace), manifest)
    wait_ready(api, namespace, "split")
    wait_for("both ranks of group split-0 ready", lambda: groups_whole(api, namespace, "split"), 60)

    group = api.get(statefulset_path(namespace, "split-0"))
    assert group["spec"]["replicas"] == 2
    assert group["spec"]["podManagementPolicy"] == "Parallel"
    assert group["spec"]["serviceName"] == "split-ranks"
    assert api.get(f"/api/v1/namespaces/{namespace}/services/split-ranks")["spec"]["clusterIP"] == "None"
    pods = sorted(live_pods(api, namespace, "split"), key=lambda pod: pod["metadata"]["name"])
    assert [pod["metadata"]["name"] for pod in pods] == ["split-0-0", "split-0-1"]
    assert [pod["metadata"]["labels"][POD_INDEX_LABEL] for pod in pods] == ["0", "1"]
    assert len({pod["spec"]["nodeName"] for pod in pods}) == 2, "one node per rank"
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"][GPU_RESOURCE] == "1"
        args = container["args"]
        assert args[args.index("--nnodes") + 1] == "2"
        assert args[args.index("--master-addr") + 1] == f"split-0-0.split-ranks.{namespace}.svc.cluster.local"
    # The clients' Service picks rank 0 alone, by the label the StatefulSet controller gave each pod.
    selector = api.get(f"/api/v1/namespaces/{namespace}/services/split")["spec"]["selector"]
    selected = [
        pod["metadata"]["name"] for pod in pods if selector.items() <= pod["metadata"]["labels"].items()
    ]
    assert selected == ["split-0-0"]

    lost = pods[1]
    api.delete(f"/api/v1/namespaces/{namespace}/pods/{lost['metadata']['name']}", {"gracePeriodSeconds": 0})

    def replaced() -> dict[str, Any] | None:
        current = {pod["metadata"]["name"]: pod for pod in live_pods(api, namespace, "split")}
        again = current.get("split-0-1")
        if again is None or again["metadata"]["uid"] == lost["metadata"]["uid"]:
            return None
        return again

    wait_for("the lost rank's pod to be replaced", replaced, 60)
    service = wait_for("the group whole again", lambda: groups_whole(api, namespace, "split"), 60)
    assert service["status"]["readyReplicas"] == 1

    # A new template: the StatefulSet waits (OnDelete) and the operator deletes both ranks' pods together.
    old = {pod["metadata"]["uid"] for pod in live_pods(api, namespace, "split")}
    old_revision = api.get(statefulset_path(namespace, "split-0"))["status"]["updateRevision"]
    patch = {"spec": {"engine": {"maxNumSeqs": 8}}}
    api.patch(services_path(namespace, "split"), patch, content_type=MERGE_PATCH)

    def restarted() -> list[dict[str, Any]] | None:
        revision = api.get(statefulset_path(namespace, "split-0"))["status"].get("updateRevision")
        pods = live_pods(api, namespace, "split")
        fresh = [
            pod
            for pod in pods
            if pod["metadata"]["uid"] not in old
            and pod["metadata"]["labels"].get("controller-revision-hash") == revision
        ]
        return fresh if revision != old_revision and len(fresh) == 2 else None

    for pod in wait_for("both ranks restarted on the new template", restarted, 60):
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "8"
    wait_for("the group whole on the new template", lambda: groups_whole(api, namespace, "split"), 60)

    def restart_events() -> list[str] | None:
        events = events_for(api, namespace, "split")
        return [event["message"] for event in events if event["reason"] == "GroupRestarted"] or None

    restarts = wait_for("the GroupRestarted event", restart_events, 30)
    assert restarts == ["Restarting group split-0 on the current template"], "one restart per template"
