"""What the operator takes on the real API server: no object of a child's name that it does not control
(a Deployment someone made keeps its owners and survives the InferenceService's deletion), and no Secret that
is not labelled for kvfleet."""

from __future__ import annotations

import base64
from typing import Any

from e2e.cluster import ApiError, LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import deployment_path, fake_gpu_service, services_path
from e2e.fleet.observe import condition, wait_condition
from e2e.support.waits import wait_for

SECRET_LABEL = "kvfleet.dev/secret"


def their_deployment(name: str) -> dict[str, Any]:
    """A Deployment of another team, at zero replicas (no pod needed)."""
    labels = {"app": name}
    container = {"name": "app", "image": "registry.invalid/billing:1"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def exists(local_cluster: LocalCluster, path: str) -> bool:
    try:
        local_cluster.api.get(path)
    except ApiError as error:
        if error.status == 404:
            return False
        raise
    return True


def test_a_deployment_of_the_childs_name_is_not_taken_over(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    api = local_cluster.api
    path = deployment_path(namespace, "billing")
    api.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", their_deployment("billing"))
    api.create(services_path(namespace), fake_gpu_service("billing", scaling={"replicas": 0}))
    service = wait_condition(api, namespace, "billing", "Ready", "False", reason="ChildNotOwned")
    assert condition(service, "Ready")["message"].startswith(
        f"Deployment {namespace}/billing already exists and has no controller: it is not taken over"
    )
    deployment = api.get(path)
    assert "ownerReferences" not in deployment["metadata"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.invalid/billing:1"
    api.delete(services_path(namespace, "billing"))
    wait_for(
        "the InferenceService to go", lambda: not exists(local_cluster, services_path(namespace, "billing"))
    )
    # The garbage collector acts on owner references within moments; it found none on theirs.
    assert exists(local_cluster, path)
    assert "ownerReferences" not in api.get(path)["metadata"]


def test_only_secrets_labelled_for_kvfleet_are_used(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    api = local_cluster.api
    key = base64.b64encode(b"k3y").decode()
    for name, labels in (("db-password", {}), ("serving-key", {SECRET_LABEL: "true"})):
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": labels}}
        api.create(f"/api/v1/namespaces/{namespace}/secrets", {**secret, "data": {"KVFLEET_API_KEY": key}})
    for name, secret in (("taker", "db-password"), ("keyed", "serving-key")):
        service = fake_gpu_service(name, engine={"apiKeySecret": secret}, scaling={"replicas": 0})
        api.create(services_path(namespace), service)
    refused = wait_condition(api, namespace, "taker", "Ready", "False", reason="SecretNotLabelled")
    assert condition(refused, "Ready")["message"].startswith(
        f"spec.engine.apiKeySecret: Secret {namespace}/db-password is not labelled kvfleet.dev/secret=true"
    )
    keyed = wait_for(
        "the keyed Deployment", lambda: exists(local_cluster, deployment_path(namespace, "keyed"))
    )
    assert keyed
    assert not exists(local_cluster, deployment_path(namespace, "taker"))
