"""The few Kubernetes API calls the operator makes itself (kopf does the watching).

Children are written with server-side apply under one field manager, and only into objects that are new
or already controlled by the child's owner; the status with a merge patch on the status subresource.
Calls are blocking (the official client); the controller runs them in worker threads.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

import kopf
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kvfleet.operator.api import FIELD_MANAGER, GROUP, PLURAL, VERSION

# kind -> plural, for every kind the operator applies or deletes.
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "StatefulSet": "statefulsets",
    "LeaderWorkerSet": "leaderworkersets",
    "Pod": "pods",
}
REQUEST_TIMEOUT_SECONDS = 30
# An object's metadata without the rest (the API server's PartialObjectMetadata), JSON as a fallback.
_METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


class KubeError(Exception):
    """A refused or failed API call, with the server's own message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ChildNotOwned(KubeError):
    """An object with a child's name exists, controlled by something else or by nothing. Applying would
    take it over, and deleting the InferenceService would then delete it: it is left alone instead."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message)


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials for kopf's own watch connections."""
    # Reading the key runs the client's refresh hook, so expiring tokens are renewed on each login.
    header = configuration.get_api_key_with_prefix("BearerToken") or ""
    scheme, _, token = header.partition(" ") if " " in header else (None, "", header)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name is not None else path


class KubeApi:
    def __init__(self, api_client: client.ApiClient, field_manager: str = FIELD_MANAGER) -> None:
        self._client = api_client
        self.field_manager = field_manager

    @property
    def configuration(self) -> client.Configuration:
        return self._client.configuration

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of one namespaced object, taking over fields other managers set; only where
        no object of its name exists or that object's controller is the manifest's (ChildNotOwned)."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        self._refuse_adoption(path, manifest)
        query = [("fieldManager", self.field_manager), ("force", "true")]
        return self._request("PATCH", path, query, manifest, "application/apply-patch+yaml")

    def _refuse_adoption(self, path: str, manifest: Mapping[str, Any]) -> None:
        # An object made between this read and the apply would still be taken over: that window is one
        # round trip, against the standing object that a name clash otherwise is.
        try:
            existing = self._request("GET", path, [], None, None, accept=_METADATA_ONLY)
        except KubeError as error:
            if error.status == 404:
                return
            raise
        controller = _controller(existing)
        if controller is not None and controller.get("uid") == (_controller(manifest) or {}).get("uid"):
            return
        meta = manifest["metadata"]
        held = (
            f"is controlled by {controller.get('kind')} {controller.get('name')}"
            if controller is not None
            else "has no controller"
        )
        raise ChildNotOwned(
            f"{manifest['kind']} {meta['namespace']}/{meta['name']} already exists and {held}: it is not"
            " taken over; delete or rename it, or rename the InferenceService"
        )

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Deletes one object and, in the background, what it owns; one already gone is no error."""
        path = resource_path(api_version, kind, namespace, name)
        self._delete(path, [("propagationPolicy", "Background")])

    def delete_pods(self, namespace: str, labels: Mapping[str, str]) -> None:
        """Deletes every pod with all of these labels."""
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        self._delete(resource_path("v1", "Pod", namespace), [("labelSelector", selector)])

    def _delete(self, path: str, query: list[tuple[str, str]]) -> None:
        try:
            self._request("DELETE", path, query, None, None)
        except KubeError as error:
            if error.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        return self._request("PATCH", path, [], {"status": status}, "application/merge-patch+json")

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None when the Secret lacks it."""
        secret = self._request("GET", _secret_path(namespace, name), [], None, None)
        value = (secret.get("data") or {}).get(key)
        return base64.b64decode(value).decode("utf-8") if value is not None else None

    def secret_labels(self, namespace: str, name: str) -> dict[str, str]:
        """A Secret's labels, read as its metadata alone (the data does not leave the API server)."""
        metadata = self._request("GET", _secret_path(namespace, name), [], None, None, accept=_METADATA_ONLY)
        return dict((metadata.get("metadata") or {}).get("labels") or {})

    def serves(self, group_version: str, plural: str) -> bool:
        """Whether the server knows a resource (e.g. ServiceMonitor once prometheus-operator is installed)."""
        try:
            listing = self._request("GET", f"/apis/{group_version}", [], None, None)
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return any(resource.get("name") == plural for resource in listing.get("resources", []))

    def ensure_cluster_peering(self, name: str) -> None:
        """Creates the kopf peering object through which operator replicas elect an active one."""
        body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
        self._create_if_missing("/apis/kopf.dev/v1/clusterkopfpeerings", body)

    def ensure_namespaced_peering(self, namespace: str, name: str) -> None:
        body = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name}}
        self._create_if_missing(f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings", body)

    def _create_if_missing(self, collection: str, body: Mapping[str, Any]) -> None:
        try:
            self._request("POST", collection, [], body, "application/json")
        except KubeError as error:
            if error.status != 409:
                raise

    def _request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]],
        body: Mapping[str, Any] | None,
        content_type: str | None,
        accept: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": accept}
        if content_type is not None:
            headers["Content-Type"] = content_type
        request = self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._client.call_api(*request, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            response.read()
        except ApiException as error:
            raise KubeError(error.status or 0, str(error.reason)) from error
        except urllib3.exceptions.HTTPError as error:
            raise KubeError(0, f"the API server did not answer: {error}") from error
        text = response.data.decode("utf-8") if response.data else ""
        if not 200 <= response.status < 300:
            raise KubeError(response.status, _server_message(text) or str(response.reason))
        return json.loads(text) if text else {}


def _controller(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The owner reference marked as the object's controller."""
    references = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((reference for reference in references if reference.get("controller")), None)


def _secret_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/secrets/{name}"


def _server_message(text: str) -> str | None:
    try:
        status = json.loads(text)
    except ValueError:
        return text.strip() or None
    return status.get("message") if isinstance(status, dict) else None
