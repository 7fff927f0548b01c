"""A small JSON client for the Kubernetes API: what the cluster and the pod runner need, as plain dicts.

Bearer-token auth over TLS verified against the cluster's CA; a fresh connection per request, so it is safe
to share between threads.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        try:
            details = json.loads(body)
            self.reason = str(details.get("reason", ""))
            message = str(details.get("message", body))
        except ValueError:
            self.reason = ""
            message = body
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {message}".strip())


class KubeAPI:
    def __init__(self, server: str, token: str, ca_file: str, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/")
        self._token = token
        self._context = ssl.create_default_context(cafile=ca_file)
        self.timeout = timeout

    def _open(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Any:
        url = self.server + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            return urllib.request.urlopen(request, context=self._context, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as error:
            raise ApiError(method, path, error.code, error.read().decode(errors="replace")) from None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        with self._open(method, path, body, params, content_type) as response:
            payload = response.read()
        return json.loads(payload) if payload else {}

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        return self.request("GET", path, params=params)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any, content_type: str = STRATEGIC_MERGE) -> dict[str, Any]:
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60) -> WatchStream:
        """Watch events ({type, object}) from resource_version until the server ends the watch."""
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_seconds,
        }
        return WatchStream(self, f"{path}?{urllib.parse.urlencode(params)}", timeout_seconds + 15)


class WatchStream:
    """One watch request; close() from another thread ends the iteration at once."""

    def __init__(self, api: KubeAPI, path_and_query: str, timeout: float) -> None:
        url = urllib.parse.urlsplit(api.server)
        self._connection = http.client.HTTPSConnection(
            url.hostname or "127.0.0.1", url.port, timeout=timeout, context=api._context
        )
        self._api = api
        self._path = path_and_query
        self._closed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._connection.request(
            "GET",
            self._path,
            headers={"Authorization": f"Bearer {self._api._token}", "Accept": "application/json"},
        )
        response = self._connection.getresponse()
        if response.status != 200:
            raise ApiError("GET", self._path, response.status, response.read().decode(errors="replace"))
        try:
            for line in response:
                if line.strip():
                    yield json.loads(line)
        except (OSError, ValueError, http.client.HTTPException) as error:
            if self._closed:
                return
            if isinstance(error, http.client.HTTPException):
                # A broken stream (a truncated chunk): the same to callers as a dropped connection.
                raise ConnectionError(f"watch stream broken: {error!r}") from error
            raise
        finally:
            self._connection.close()

    def close(self) -> None:
        self._closed = True
        if self._connection.sock is not None:
            with contextlib.suppress(OSError):
                self._connection.sock.shutdown(socket.SHUT_RDWR)


def now_timestamp() -> str:
    """The current time as the API writes timestamps (RFC 3339, UTC, whole seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pods_path(namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def write_kubeconfig(
    path: Path, server: str, ca_cert: Path, user: str, token: str, namespace: str | None = None
) -> Path:
    """A kubeconfig that reaches `server` as `user` with a bearer token; only its owner may read it."""
    context = {"cluster": "kvfleet-local", "user": user}
    if namespace is not None:
        context["namespace"] = namespace
    ca_data = base64.b64encode(ca_cert.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "kvfleet-local", "cluster": {"server": server, "certificate-authority-data": ca_data}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "kvfleet-local", "context": context}],
        "current-context": "kvfleet-local",
    }
    path.touch(mode=0o600)
    path.chmod(0o600)  # touch leaves an existing file's mode alone
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
