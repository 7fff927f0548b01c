"""Services as the cluster's DNS and Service proxy see them: each Service with its ready endpoints and, for a
ClusterIP Service, the loopback address that stands in for its ClusterIP.

The API server refuses loopback addresses in EndpointSlices, so the endpoints are computed from the pods,
as the EndpointSlice controller would: the pods of the Service's namespace that its selector matches, with
an IP, not terminating, not finished, and Ready (or any of them, with publishNotReadyAddresses). ClusterIPs
lead nowhere on this host, so each ClusterIP Service gets an address of its own from a loopback range of
the cluster's, released when the Service goes.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .kube_api import ApiError, KubeAPI, WatchStream

log = logging.getLogger("kvfleet.e2e.services")

ObjectKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class ServicePort:
    name: str
    port: int
    protocol: str
    # A number, or the name of a container port of each endpoint pod.
    target: int | str


@dataclass(frozen=True)
class Endpoint:
    pod: str
    ip: str
    # The pod's spec.hostname when its spec.subdomain names this Service (a StatefulSet's pods).
    hostname: str | None
    container_ports: Mapping[str, int]

    def target_port(self, port: ServicePort) -> int | None:
        """Where this endpoint serves `port`; None when its pod has no container port of that name."""
        if isinstance(port.target, int):
            return port.target
        return self.container_ports.get(port.target)


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    # The loopback address answering for the ClusterIP; None for a headless Service.
    address: str | None
    ports: tuple[ServicePort, ...]
    endpoints: tuple[Endpoint, ...]


def _selects(selector: Mapping[str, str] | None, pod: Mapping[str, Any]) -> bool:
    """A Service without a selector selects no pod (its endpoints would be managed by hand)."""
    if not selector:
        return False
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


def _is_endpoint(pod: Mapping[str, Any], publish_not_ready: bool) -> bool:
    status = pod.get("status") or {}
    if not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
        return False
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
    return ready or publish_not_ready


def service_ports(spec: Mapping[str, Any]) -> tuple[ServicePort, ...]:
    ports = []
    for port in spec.get("ports") or []:
        target = port.get("targetPort", port["port"])
        ports.append(
            ServicePort(
                name=port.get("name", ""),
                port=int(port["port"]),
                protocol=port.get("protocol", "TCP"),
                target=target if isinstance(target, str) else int(target),
            )
        )
    return tuple(ports)


def endpoints_of(service: Mapping[str, Any], pods: Mapping[str, Mapping[str, Any]]) -> tuple[Endpoint, ...]:
    """The endpoints of a Service among the pods of its namespace (name -> pod), by pod name."""
    spec = service["spec"]
    selector = spec.get("selector")
    publish_not_ready = bool(spec.get("publishNotReadyAddresses"))
    endpoints = []
    for name, pod in sorted(pods.items()):
        if not _selects(selector, pod) or not _is_endpoint(pod, publish_not_ready):
            continue
        pod_spec = pod["spec"]
        hostname = (
            pod_spec.get("hostname") if pod_spec.get("subdomain") == service["metadata"]["name"] else None
        )
        ports = {
            port["name"]: int(port["containerPort"])
            for container in pod_spec.get("containers", [])
            for port in container.get("ports", [])
            if port.get("name")
        }
        endpoints.append(Endpoint(name, pod["status"]["podIP"], hostname, ports))
    return tuple(endpoints)


def is_headless(service: Mapping[str, Any]) -> bool:
    return service["spec"].get("clusterIP") == "None"


class LoopbackAddresses:
    """The Service addresses of a loopback range, one per Service (by uid): a released one is handed out
    again before a new one; `reserved` are never handed out."""

    def __init__(self, subnet: str, reserved: frozenset[str]) -> None:
        self._hosts = ipaddress.ip_network(subnet).hosts()
        self._reserved = reserved
        self._free: list[str] = []
        self._by_uid: dict[str, str] = {}

    def address(self, uid: str) -> str:
        if uid not in self._by_uid:
            if self._free:
                self._by_uid[uid] = self._free.pop()
            else:
                self._by_uid[uid] = next(str(h) for h in self._hosts if str(h) not in self._reserved)
        return self._by_uid[uid]

    def release(self, uid: str) -> None:
        address = self._by_uid.pop(uid, None)
        if address is not None:
            self._free.append(address)


class ResourceWatch(threading.Thread):
    """Lists a resource, then watches it from the list's resourceVersion, and lists again when the watch
    breaks or expires; each object added, changed (`on_change(old, new)`) or deleted (`new` None) is
    reported from this thread, and a relist reports the difference."""

    def __init__(
        self,
        api: KubeAPI,
        path: str,
        on_change: Callable[[dict[str, Any] | None, dict[str, Any] | None], None],
        stopping: threading.Event,
    ) -> None:
        super().__init__(name=f"watch-{path}", daemon=True)
        self._api = api
        self._path = path
        self._on_change = on_change
        self._stopping = stopping
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        self._stream: WatchStream | None = None
        self.synced = threading.Event()

    def close(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.close()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._list_and_watch()
            except (OSError, ApiError, ValueError) as error:
                if not self._stopping.is_set():
                    log.warning("watch of %s restarts after: %s", self._path, error)
                    self._stopping.wait(1.0)

    def _list_and_watch(self) -> None:
        listing = self._api.get(self._path)
        listed = {_key(item): item for item in listing["items"]}
        for key in set(self._objects) - set(listed):
            self._apply("DELETED", self._objects[key])
        for item in listed.values():
            self._apply("MODIFIED", item)
        self.synced.set()
        resource_version = listing["metadata"]["resourceVersion"]
        while not self._stopping.is_set():
            self._stream = self._api.watch(self._path, resource_version)
            for event in self._stream:
                if event["type"] == "ERROR":  # e.g. 410 Gone: the resourceVersion expired
                    raise ApiError("WATCH", self._path, event["object"].get("code", 0), str(event["object"]))
                resource_version = event["object"]["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    self._apply(event["type"], event["object"])

    def _apply(self, kind: str, item: dict[str, Any]) -> None:
        key = _key(item)
        old = self._objects.get(key)
        new = None if kind == "DELETED" else item
        if new is None:
            self._objects.pop(key, None)
        else:
            self._objects[key] = new
        if old is not None or new is not None:
            self._on_change(old, new)


def _key(item: Mapping[str, Any]) -> ObjectKey:
    return item["metadata"]["namespace"], item["metadata"]["name"]


class ServiceTable:
    """Every Service of the cluster with its endpoints, kept current from watches of Services and Pods.

    `on_service(key, service)` hears of each Service whose address, ports or endpoints may have changed
    (None: it is gone). Lookups are safe from any thread.
    """

    def __init__(
        self,
        api: KubeAPI,
        addresses: LoopbackAddresses,
        on_service: Callable[[ObjectKey, Service | None], None],
    ) -> None:
        self._addresses = addresses
        self._on_service = on_service
        self._lock = threading.Lock()
        self._service_objects: dict[ObjectKey, dict[str, Any]] = {}
        self._pods: dict[str, dict[str, dict[str, Any]]] = {}  # namespace -> name -> pod
        self._services: dict[ObjectKey, Service] = {}
        self._stopping = threading.Event()
        self._watches = [
            ResourceWatch(api, "/api/v1/services", self._service_changed, self._stopping),
            ResourceWatch(api, "/api/v1/pods", self._pod_changed, self._stopping),
        ]

    def start(self, timeout: float) -> None:
        """Starts watching; returns once both first lists are in."""
        for watch in self._watches:
            watch.start()
        for watch in self._watches:
            if not watch.synced.wait(timeout):
                raise TimeoutError(f"{watch.name}: no first list within {timeout:.0f}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Ends both watches and joins their threads; raises if one is still alive after `timeout`."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for watch in self._watches:
            # Closed again until it ends: a close can come before the watch's connection is made.
            while watch.is_alive() and time.monotonic() < deadline:
                watch.close()
                watch.join(timeout=0.1)
        alive = [watch.name for watch in self._watches if watch.is_alive()]
        if alive:
            raise RuntimeError(f"watches did not stop: {alive}")

    def get(self, namespace: str, name: str) -> Service | None:
        return self._services.get((namespace, name))

    def _service_changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        with self._lock:
            if new is None:
                assert old is not None
                key = _key(old)
                self._service_objects.pop(key, None)
                self._addresses.release(old["metadata"]["uid"])
                self._publish(key, None)
                return
            key = _key(new)
            if old is not None and old["metadata"]["uid"] != new["metadata"]["uid"]:
                self._addresses.release(old["metadata"]["uid"])
            self._service_objects[key] = new
            self._refresh(key)

    def _pod_changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        pod = new or old
        assert pod is not None
        namespace, name = _key(pod)
        with self._lock:
            pods = self._pods.setdefault(namespace, {})
            if new is None:
                pods.pop(name, None)
            else:
                pods[name] = new
            for key, service in self._service_objects.items():
                if key[0] != namespace:
                    continue
                selector = service["spec"].get("selector")
                if any(p is not None and _selects(selector, p) for p in (old, new)):
                    self._refresh(key)

    def _refresh(self, key: ObjectKey) -> None:
        service = self._service_objects[key]
        # An ExternalName Service (a CNAME to a name elsewhere) is not served: no address, no endpoints.
        external = service["spec"].get("type") == "ExternalName"
        address = None
        if not external and not is_headless(service):
            address = self._addresses.address(service["metadata"]["uid"])
        entry = Service(
            namespace=key[0],
            name=key[1],
            address=address,
            ports=service_ports(service["spec"]),
            endpoints=() if external else endpoints_of(service, self._pods.get(key[0], {})),
        )
        if self._services.get(key) != entry:
            self._publish(key, entry)

    def _publish(self, key: ObjectKey, entry: Service | None) -> None:
        if entry is None:
            self._services.pop(key, None)
        else:
            self._services[key] = entry
        self._on_service(key, entry)
