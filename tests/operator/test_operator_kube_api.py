"""The operator's API calls, as HTTP requests seen by a recording stand-in for the API server.

Only the wire format is checked here (paths, verbs, content types, field manager); how a real server
merges the applies is the end-to-end tests' job.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlsplit

import pytest
from kubernetes import client
from kvfleet.operator.kube import ChildNotOwned, KubeApi, KubeError, connection_info, resource_path


class Recorder(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict[str, Any]]] = []
    replies: ClassVar[dict[tuple[str, str], tuple[int, dict[str, Any]]]] = {}

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        url = urlsplit(self.path)
        body = self.rfile.read(length).decode() if length else ""
        self.requests.append(
            {
                "method": self.command,
                "path": url.path,
                "query": dict(parse_qsl(url.query)),
                "content_type": self.headers.get("Content-Type"),
                "authorization": self.headers.get("Authorization"),
                "accept": self.headers.get("Accept"),
                "body": json.loads(body) if body else None,
            }
        )
        status, reply = self.replies.get((self.command, url.path), (200, {"kind": "Echo"}))
        payload = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[tuple[KubeApi, type[Recorder]]]:
    Recorder.requests, Recorder.replies = [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    configuration.api_key = {"BearerToken": "secret-token"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    api_client = client.ApiClient(configuration)
    try:
        yield KubeApi(api_client), Recorder
    finally:
        api_client.close()
        server.shutdown()
        server.server_close()
        thread.join()


DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/ns/deployments/svc"


def owner_reference(uid: str, kind: str = "InferenceService", name: str = "svc") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "name": name, "uid": uid, "controller": True}


def child(**spec: Any) -> dict[str, Any]:
    """A Deployment as the operator renders it: controlled by its InferenceService."""
    metadata = {"name": "svc", "namespace": "ns", "ownerReferences": [owner_reference("uid-1")]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": spec}


def test_apply_is_a_forced_server_side_apply(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    manifest = child(replicas=2)
    recorder.replies[("GET", DEPLOYMENT_PATH)] = (404, {"message": "not found"})
    assert kube.apply(manifest) == {"kind": "Echo"}
    look, request = recorder.requests
    assert (look["method"], look["path"]) == ("GET", DEPLOYMENT_PATH), "first: is the name free, or ours?"
    assert request["method"] == "PATCH"
    assert request["path"] == "/apis/apps/v1/namespaces/ns/deployments/svc"
    assert request["query"] == {"fieldManager": "kvfleet-operator", "force": "true"}
    assert request["content_type"] == "application/apply-patch+yaml"
    assert request["authorization"] == "Bearer secret-token"
    assert request["body"] == manifest


def test_an_object_of_the_childs_name_is_taken_over_only_when_the_owner_controls_it(
    api: tuple[KubeApi, type[Recorder]],
) -> None:
    """A Deployment someone else made, or one another owner controls, keeps its fields and its owners:
    applying would add this InferenceService as its controller, and deleting the service would delete it."""
    kube, recorder = api
    theirs = {"metadata": {"name": "svc", "namespace": "ns", "labels": {"app": "billing"}}}
    recorder.replies[("GET", DEPLOYMENT_PATH)] = (200, theirs)
    with pytest.raises(ChildNotOwned) as raised:
        kube.apply(child(replicas=1))
    assert raised.value.message == (
        "Deployment ns/svc already exists and has no controller: it is not taken over; delete or rename it,"
        " or rename the InferenceService"
    )
    held = {"metadata": {"name": "svc", "ownerReferences": [owner_reference("uid-9", "Rollout", "billing")]}}
    recorder.replies[("GET", DEPLOYMENT_PATH)] = (200, held)
    with pytest.raises(ChildNotOwned, match="already exists and is controlled by Rollout billing"):
        kube.apply(child(replicas=1))
    # A child of an earlier InferenceService of the same name (another uid) is not this one's either.
    recorder.replies[("GET", DEPLOYMENT_PATH)] = (
        200,
        {"metadata": {"ownerReferences": [owner_reference("uid-0")]}},
    )
    with pytest.raises(ChildNotOwned, match="is controlled by InferenceService svc"):
        kube.apply(child(replicas=1))
    assert {request["method"] for request in recorder.requests} == {"GET"}, "nothing was written"
    assert "PartialObjectMetadata" in recorder.requests[0]["accept"], "only the metadata is read"
    recorder.replies[("GET", DEPLOYMENT_PATH)] = (200, child(replicas=3))
    kube.apply(child(replicas=1))
    assert recorder.requests[-1]["method"] == "PATCH", "its own child is applied"


def test_a_secrets_labels_are_read_without_its_data(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    path = "/api/v1/namespaces/ns/secrets/keys"
    recorder.replies[("GET", path)] = (
        200,
        {"metadata": {"name": "keys", "labels": {"kvfleet.dev/secret": "true"}}},
    )
    assert kube.secret_labels("ns", "keys") == {"kvfleet.dev/secret": "true"}
    (request,) = recorder.requests
    assert request["path"] == path
    assert request["accept"].startswith("application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1")


def test_paths_of_every_child_kind() -> None:
    assert resource_path("v1", "Service", "ns", "a") == "/api/v1/namespaces/ns/services/a"
    assert resource_path("policy/v1", "PodDisruptionBudget", "ns", "a") == (
        "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/a"
    )
    assert resource_path("monitoring.coreos.com/v1", "ServiceMonitor", "ns") == (
        "/apis/monitoring.coreos.com/v1/namespaces/ns/servicemonitors"
    )


def test_deletes_take_what_the_object_owns_and_pass_over_what_is_gone(
    api: tuple[KubeApi, type[Recorder]],
) -> None:
    kube, recorder = api
    recorder.replies[("DELETE", "/apis/apps/v1/namespaces/ns/statefulsets/gone")] = (404, {"message": "gone"})
    kube.delete("apps/v1", "StatefulSet", "ns", "svc-1")
    kube.delete("apps/v1", "StatefulSet", "ns", "gone")
    kube.delete("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "ns", "svc-ranks")
    first, _, lws = recorder.requests
    assert (first["method"], first["path"]) == ("DELETE", "/apis/apps/v1/namespaces/ns/statefulsets/svc-1")
    assert first["query"] == {"propagationPolicy": "Background"}
    assert lws["path"] == "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns/leaderworkersets/svc-ranks"
    recorder.replies[("DELETE", "/apis/apps/v1/namespaces/ns/statefulsets/denied")] = (403, {"message": "no"})
    with pytest.raises(KubeError):
        kube.delete("apps/v1", "StatefulSet", "ns", "denied")


def test_a_group_is_restarted_by_deleting_its_pods_together(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    kube.delete_pods("ns", {"kvfleet.dev/inference-service": "svc", "kvfleet.dev/group": "1"})
    (request,) = recorder.requests
    assert (request["method"], request["path"]) == ("DELETE", "/api/v1/namespaces/ns/pods")
    assert request["query"] == {"labelSelector": "kvfleet.dev/group=1,kvfleet.dev/inference-service=svc"}


def test_status_is_a_merge_patch_on_the_subresource(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    kube.patch_status("ns", "svc", {"observedGeneration": 3, "autoscaler": None})
    (request,) = recorder.requests
    assert request["path"] == "/apis/kvfleet.dev/v1alpha1/namespaces/ns/inferenceservices/svc/status"
    assert request["content_type"] == "application/merge-patch+json"
    assert request["body"] == {"status": {"observedGeneration": 3, "autoscaler": None}}


def test_server_messages_become_errors(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    recorder.replies[("GET", DEPLOYMENT_PATH)] = (200, child())
    recorder.replies[("PATCH", DEPLOYMENT_PATH)] = (
        422,
        {"kind": "Status", "message": "spec.replicas: Invalid value: -1"},
    )
    with pytest.raises(KubeError) as raised:
        kube.apply(child(replicas=-1))
    assert raised.value.status == 422
    assert raised.value.message == "spec.replicas: Invalid value: -1"


def test_discovery_of_optional_apis(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    recorder.replies[("GET", "/apis/monitoring.coreos.com/v1")] = (
        200,
        {"resources": [{"name": "servicemonitors"}, {"name": "podmonitors"}]},
    )
    assert kube.serves("monitoring.coreos.com/v1", "servicemonitors")
    recorder.replies[("GET", "/apis/monitoring.coreos.com/v1")] = (404, {"message": "not found"})
    assert not kube.serves("monitoring.coreos.com/v1", "servicemonitors")


def test_peering_objects_are_created_once(api: tuple[KubeApi, type[Recorder]]) -> None:
    kube, recorder = api
    kube.ensure_cluster_peering("kvfleet")
    recorder.replies[("POST", "/apis/kopf.dev/v1/namespaces/team-a/kopfpeerings")] = (
        409,
        {"message": "exists"},
    )
    kube.ensure_namespaced_peering("team-a", "kvfleet")
    assert [r["path"] for r in recorder.requests] == [
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        "/apis/kopf.dev/v1/namespaces/team-a/kopfpeerings",
    ]
    assert recorder.requests[0]["body"]["metadata"] == {"name": "kvfleet"}
    recorder.replies[("POST", "/apis/kopf.dev/v1/clusterkopfpeerings")] = (403, {"message": "forbidden"})
    with pytest.raises(KubeError, match="forbidden"):
        kube.ensure_cluster_peering("kvfleet")


def test_unreachable_server_is_a_kube_error() -> None:
    configuration = client.Configuration(host="http://127.0.0.1:9")
    configuration.retries = 0
    with client.ApiClient(configuration) as api_client, pytest.raises(KubeError, match="did not answer"):
        KubeApi(api_client).patch_status("ns", "svc", {})


def test_kopf_gets_the_same_credentials() -> None:
    configuration = client.Configuration(host="https://10.0.0.1:6443")
    configuration.api_key = {"BearerToken": "abc"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    configuration.ssl_ca_cert = "/etc/ca.crt"
    info = connection_info(configuration)
    assert (info.server, info.scheme, info.token, info.ca_path) == (
        "https://10.0.0.1:6443",
        "Bearer",
        "abc",
        "/etc/ca.crt",
    )
    assert info.insecure is False
