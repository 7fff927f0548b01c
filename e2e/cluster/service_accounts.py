"""A pod's ServiceAccount credentials, as a kubelet obtains them: a bound token from the TokenRequest API."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .kube_api import KubeAPI, write_kubeconfig

SERVICE_ACCOUNT_TOKEN_SECONDS = 24 * 3600


class ServiceAccounts:
    """Tokens and kubeconfigs for the API server at server, whose CA is ca_cert."""

    def __init__(self, api: KubeAPI, server: str, ca_cert: Path | None) -> None:
        self.api = api
        self.server = server
        self.ca_cert = ca_cert

    def token(self, pod: Mapping[str, Any]) -> str:
        """A token of the pod's ServiceAccount, bound to the pod (it ends when the pod is deleted)."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": SERVICE_ACCOUNT_TOKEN_SECONDS,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        return self.api.create(path, request)["status"]["token"]

    def kubeconfig(self, pod: Mapping[str, Any], pod_dir: Path) -> Path | None:
        """A kubeconfig with the pod's ServiceAccount token: processes get exactly the pod's RBAC rights."""
        if pod["spec"].get("automountServiceAccountToken") is False or self.ca_cert is None:
            return None
        path = pod_dir / "kubeconfig"
        if not path.exists():
            token = self.token(pod)
            write_kubeconfig(path, self.server, self.ca_cert, "pod", token, pod["metadata"]["namespace"])
        return path
