"""The local control plane itself: real API server, controllers, scheduler, and kwok's fake GPU nodes."""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes
import pytest

from e2e.cluster import GPU_RESOURCE, ApiError, KubeAPI, LocalCluster
from e2e.support.waits import condition, wait_for

VERSIONS = dict(
    line.split("=", 1)
    for line in (Path(__file__).parent / "cluster" / "versions.env").read_text().splitlines()
    if line and not line.startswith("#")
)
# An image the pod runner does not run: kwok alone plays the pod's lifecycle.
FAKE_IMAGE = "registry.invalid/sleeper:1"


def gpu_pod(name: str, gpus: int, image: str = FAKE_IMAGE) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {"name": "main", "image": image, "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}
            ],
        },
    }


def test_server_reports_pinned_version(local_cluster: LocalCluster) -> None:
    version = local_cluster.api.get("/version")
    assert version["gitVersion"] == VERSIONS["KUBERNETES_VERSION"]
    assert version["major"] == "1"
    assert version["minor"] == VERSIONS["KUBERNETES_VERSION"].split(".")[1]
    output = local_cluster.kubectl("version", "-o", "json").stdout
    reported = json.loads(output)
    assert reported["clientVersion"]["gitVersion"] == VERSIONS["KUBERNETES_VERSION"]
    assert reported["serverVersion"]["gitVersion"] == VERSIONS["KUBERNETES_VERSION"]


def test_fake_gpu_nodes_are_ready(local_cluster: LocalCluster) -> None:
    nodes = local_cluster.api.get("/api/v1/nodes")["items"]
    assert len(nodes) == local_cluster.config.nodes
    for node in nodes:
        ready = condition(node, "Ready")
        assert ready is not None and ready["status"] == "True", node["metadata"]["name"]
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(local_cluster.config.node_shape.gpus)
        assert node["status"]["capacity"][GPU_RESOURCE] == str(local_cluster.config.node_shape.gpus)
    # kwok keeps them alive through node leases, as kubelets do.
    leases = local_cluster.api.get("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases")["items"]
    assert {lease["metadata"]["name"] for lease in leases} >= {node["metadata"]["name"] for node in nodes}


def test_gpu_pod_is_scheduled_onto_a_fake_node(local_cluster: LocalCluster, namespace: str) -> None:
    api = local_cluster.api
    api.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("two-gpus", 2))

    def running() -> dict | None:
        pod = api.get(f"/api/v1/namespaces/{namespace}/pods/two-gpus")
        ready = condition(pod, "Ready")
        return pod if ready and ready["status"] == "True" else None

    pod = wait_for("the pod Running and Ready", running)
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["nodeName"].startswith("kwok-gpu-")
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(local_cluster.pod_cidr)
    scheduled = condition(pod, "PodScheduled")
    assert scheduled is not None and scheduled["status"] == "True"


def test_pod_asking_for_more_gpus_than_a_node_has_stays_pending(
    local_cluster: LocalCluster, namespace: str
) -> None:
    api = local_cluster.api
    too_many = local_cluster.config.node_shape.gpus + 1
    api.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("too-many-gpus", too_many))

    def unschedulable() -> dict | None:
        pod = api.get(f"/api/v1/namespaces/{namespace}/pods/too-many-gpus")
        scheduled = condition(pod, "PodScheduled")
        return pod if scheduled and scheduled["status"] == "False" else None

    pod = wait_for("PodScheduled=False", unschedulable)
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]
    assert condition(pod, "PodScheduled")["reason"] == "Unschedulable"

    def failed_scheduling() -> list[dict]:
        events = api.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        return [
            e
            for e in events
            if e["reason"] == "FailedScheduling" and e["involvedObject"]["name"] == "too-many-gpus"
        ]

    events = wait_for("a FailedScheduling event", failed_scheduling)
    assert f"Insufficient {GPU_RESOURCE}" in events[0]["message"]


def test_deployment_rolls_out_and_garbage_collection_removes_its_pods(
    local_cluster: LocalCluster, namespace: str
) -> None:
    api = local_cluster.api
    labels = {"app": "web"}
    api.create(
        f"/apis/apps/v1/namespaces/{namespace}/deployments",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": gpu_pod("x", 1)["spec"]},
            },
        },
    )
    deployment_path = f"/apis/apps/v1/namespaces/{namespace}/deployments/web"
    wait_for(
        "3 available replicas",
        lambda: api.get(deployment_path).get("status", {}).get("availableReplicas") == 3,
    )
    pods = api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector="app=web")["items"]
    assert len(pods) == 3
    owner = pods[0]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and owner["controller"] is True

    api.delete(deployment_path, {"propagationPolicy": "Background"})
    wait_for(
        "the garbage collector to remove the ReplicaSet's pods",
        lambda: not api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector="app=web")["items"],
    )
    assert not api.get(f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"]


def _status_without_auth(local_cluster: LocalCluster, token: str | None) -> int:
    request = urllib.request.Request(f"{local_cluster.server}/api/v1/namespaces/default/pods")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(local_cluster.ca_cert))
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_token_authentication_and_rbac(local_cluster: LocalCluster, namespace: str) -> None:
    api = local_cluster.api
    assert _status_without_auth(local_cluster, "not-a-valid-token") == 401
    assert _status_without_auth(local_cluster, None) in (401, 403)  # anonymous: never allowed to list pods

    api.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
    )
    token = api.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/reader/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 600},
        },
    )["status"]["token"]
    reader = KubeAPI(local_cluster.server, token, str(local_cluster.ca_cert))
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    with pytest.raises(ApiError) as denied:
        reader.get(pods_path)
    assert denied.value.status == 403

    api.create(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    api.create(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    assert wait_for("the binding to take effect", lambda: _allowed(reader, pods_path))
    with pytest.raises(ApiError) as still_denied:  # the Role grants nothing cluster-wide
        reader.get("/api/v1/nodes")
    assert still_denied.value.status == 403
    whoami = reader.create(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"


def _allowed(client: KubeAPI, path: str) -> bool:
    try:
        client.get(path)
        return True
    except ApiError as error:
        if error.status != 403:
            raise
        return False


def test_official_python_client_works_with_the_admin_kubeconfig(local_cluster: LocalCluster) -> None:
    client = kubernetes.config.new_client_from_config(config_file=str(local_cluster.kubeconfig))
    try:
        nodes = kubernetes.client.CoreV1Api(client).list_node()
        assert len(nodes.items) == local_cluster.config.nodes
    finally:
        client.close()
