"""Discovery from the cluster: InferenceServices and their replicas' pods.

The gateway reads the pods themselves, as the Gateway API inference extension's endpoint picker does, not
the EndpointSlices of the services' Services: a pod's readiness is seen as soon as the kubelet reports it,
without an endpoints controller in between, and the pod's name travels with its address. Each resource is
listed, then watched from the list's resourceVersion, in a thread of its own (the official client blocks);
an expired or broken watch lists again. Every change republishes the fleet, computed by the pure
`model_configs` from the objects as they are.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from kvfleet.contract.engine import preempts
from kvfleet.contract.tiers import TIERS
from kvfleet.gateway.discovery import ClientKey, ModelConfig, Publish
from kvfleet.operator.api import (
    API_KEY_ENV,
    GROUP,
    HTTP_PORT_NAME,
    PLURAL,
    SERVICE_LABEL,
    VERSION,
    claim_order,
    qualified_name,
    serves_api,
)
from kvfleet.operator.spec import SpecError, parse_spec

logger = logging.getLogger(__name__)

# A watch ends after this long and is resumed, so a stopped discovery's threads notice within it.
WATCH_SECONDS = 30
RELIST_BACKOFF_SECONDS = 2.0
# The services' API keys are read again this often (a rotated key is honoured within it), and the fleet
# republished.
KEY_REFRESH_SECONDS = 60.0

ObjectKey = tuple[str, str]


def model_configs(
    services: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    defaults: ModelConfig,
    keys: Mapping[ObjectKey, ClientKey] | None = None,
) -> dict[str, ModelConfig]:
    """The fleet as the gateway routes it: one entry per service, under its qualified name
    (`NAMESPACE/SERVED_NAME`), with its ready replicas.

    `keys` holds the API keys read from the services' Secrets, by (namespace, Secret name). Of the services of
    one namespace serving the same name, the one that `claim_order` puts first owns it; the others are not
    routed (their operator reports the conflict).
    """
    endpoints: dict[ObjectKey, list[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        service = labels.get(SERVICE_LABEL)
        url = _ready_url(pod)
        # Of a group spanning nodes, only rank 0 serves the API.
        if service is not None and url is not None and serves_api(labels):
            endpoints.setdefault((meta.get("namespace", ""), service), []).append(url)
    models: dict[str, ModelConfig] = {}
    owners: dict[str, str] = {}
    for service in sorted(services, key=lambda service: (_key(service)[0], claim_order(_meta(service)))):
        key = _key(service)
        namespace, name = key
        try:
            spec = parse_spec(service.get("spec") or {}, name=name)
        except SpecError as error:
            logger.warning("%s/%s is not routed: %s", namespace, name, error.message)
            continue
        served = spec.model.served_name
        routed = qualified_name(namespace, served)
        if routed in owners:
            owner = owners[routed]
            logger.warning(
                "%s/%s serves %r, which %s/%s owns: not routed", namespace, name, served, namespace, owner
            )
            continue
        owners[routed] = name
        routing, scaling = spec.routing, spec.scaling
        secret = spec.engine.api_key_secret
        models[routed] = dataclasses.replace(
            defaults,
            name=routed,
            namespace=namespace,
            served_name=served,
            endpoints=tuple(sorted(set(endpoints.get(key, ())))),
            policy=routing.policy or defaults.policy,
            prefix_chars=routing.prefix_characters or defaults.prefix_chars,
            load_bound=(routing.load_bound_percent / 100)
            if routing.load_bound_percent
            else defaults.load_bound,
            max_in_flight=spec.engine.max_num_seqs or defaults.max_in_flight,
            replicas_preempt=preempts(spec.scheduling_policy),
            hold_seconds=float(scaling.activation_timeout_seconds or defaults.hold_seconds),
            default_priority=TIERS[spec.sla.tier],
            client_key=_client_key(namespace, secret, keys or {}),
            # Checked equal to the service's own key before it goes on; a service with none needs none.
            forward_authorization=secret is not None,
        )
    return models


def _client_key(namespace: str, secret: str | None, keys: Mapping[ObjectKey, ClientKey]) -> ClientKey | None:
    if secret is None:
        return None
    # Not read (yet): refused rather than open.
    return keys.get((namespace, secret), ClientKey(None))


def key_secrets(services: Iterable[Mapping[str, Any]]) -> set[ObjectKey]:
    """The (namespace, Secret name) of every service's API key."""
    found = set()
    for service in services:
        engine = (service.get("spec") or {}).get("engine") or {}
        secret = engine.get("apiKeySecret") if isinstance(engine, Mapping) else None
        if isinstance(secret, str) and secret:
            found.add((_key(service)[0], secret))
    return found


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = _meta(obj)
    return meta.get("namespace", ""), meta.get("name", "")


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _ready_url(pod: Mapping[str, Any]) -> str | None:
    """The replica's base URL while it is Ready and not terminating; None otherwise."""
    status = pod.get("status") or {}
    ready = any(
        condition.get("type") == "Ready" and condition.get("status") == "True"
        for condition in status.get("conditions") or []
    )
    address = status.get("podIP")
    if not ready or not address or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    ports = [
        port.get("containerPort")
        for container in (pod.get("spec") or {}).get("containers") or []
        for port in container.get("ports") or []
        if port.get("name") == HTTP_PORT_NAME
    ]
    if not ports:
        return None
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{ports[0]}"


class KubernetesDiscovery:
    """Watches InferenceServices and their replicas' pods, in every namespace or in the given ones."""

    def __init__(
        self, api_client: client.ApiClient, namespaces: Sequence[str], defaults: ModelConfig
    ) -> None:
        self._objects = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        self._serialize = api_client.sanitize_for_serialization
        # (namespace, Secret name) -> (when read, the key).
        self._keys: dict[ObjectKey, tuple[float, ClientKey]] = {}
        self._namespaces: Sequence[str | None] = list(namespaces) or [None]
        self._defaults = defaults

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        stop = threading.Event()
        # The watcher threads write the stores while the event loop reads them.
        lock = threading.Lock()
        resources = [(GROUP, VERSION, PLURAL, None), ("", "v1", "pods", SERVICE_LABEL)]
        watches = [_Watch(*resource, namespace) for resource in resources for namespace in self._namespaces]

        def notify() -> None:
            if not stop.is_set():  # once stopped, the loop may be gone
                loop.call_soon_threadsafe(changed.set)

        for watched in watches:
            thread = threading.Thread(
                target=self._list_and_watch,
                args=(watched, lock, notify, stop),
                name=f"kvfleet-gateway-{watched.plural}",
                daemon=True,
            )
            thread.start()
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KEY_REFRESH_SECONDS):
                        await changed.wait()
                changed.clear()
                if all(watched.synced.is_set() for watched in watches):
                    with lock:
                        services = [obj for w in watches if w.plural == PLURAL for obj in w.store.values()]
                        pods = [obj for w in watches if w.plural != PLURAL for obj in w.store.values()]
                    keys = await asyncio.to_thread(self._read_keys, key_secrets(services))
                    publish(model_configs(services, pods, self._defaults, keys))
        finally:
            stop.set()

    def _read_keys(self, secrets: set[ObjectKey]) -> dict[ObjectKey, ClientKey]:
        """The API keys of the given Secrets, each read again once it is KEY_REFRESH_SECONDS old."""
        now = time.monotonic()
        self._keys = {secret: read for secret, read in self._keys.items() if secret in secrets}
        for namespace, name in secrets - {
            s for s, (at, _) in self._keys.items() if now - at < KEY_REFRESH_SECONDS
        }:
            try:
                data = self._core.read_namespaced_secret(name, namespace).data or {}
                value = data.get(API_KEY_ENV)
                digest = hashlib.sha256(base64.b64decode(value)).digest() if value else None
            except ApiException as error:
                logger.warning("cannot read the API key Secret %s/%s: %s", namespace, name, error.reason)
                digest = None
            self._keys[(namespace, name)] = (now, ClientKey(digest))
        return {secret: key for secret, (_, key) in self._keys.items()}

    def _list_and_watch(
        self, watched: _Watch, lock: threading.Lock, notify: Callable[[], None], stop: threading.Event
    ) -> None:
        """Runs in its own thread until `stop`: keeps the watch's store equal to the cluster's objects."""
        scope: dict[str, Any] = {} if watched.namespace is None else {"namespace": watched.namespace}
        if watched.label_selector:
            scope["label_selector"] = watched.label_selector
        list_call: Callable[..., Any]
        if watched.group:
            # By keyword: the namespaced call takes the namespace between the version and the plural.
            scope.update(group=watched.group, version=watched.version, plural=watched.plural)
            namespaced, cluster_wide = (
                self._objects.list_namespaced_custom_object,
                self._objects.list_cluster_custom_object,
            )
        else:
            namespaced, cluster_wide = self._core.list_namespaced_pod, self._core.list_pod_for_all_namespaces
        list_call = cluster_wide if watched.namespace is None else namespaced
        while not stop.is_set():
            try:
                # Typed lists (pods) become the API's JSON shape, as custom objects already are.
                listing = self._serialize(list_call(**scope))
                fresh = {_key(item): item for item in listing.get("items", [])}
                with lock:
                    watched.store.clear()
                    watched.store.update(fresh)
                watched.synced.set()
                notify()
                version_seen = listing["metadata"]["resourceVersion"]
                while not stop.is_set():
                    stream = watch.Watch().stream(
                        list_call,
                        **scope,
                        resource_version=version_seen,
                        timeout_seconds=WATCH_SECONDS,
                        allow_watch_bookmarks=True,
                    )
                    for event in stream:
                        obj = event.get("raw_object") or event["object"]
                        if event["type"] == "ERROR":
                            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                        version_seen = obj["metadata"]["resourceVersion"]
                        with lock:
                            if event["type"] == "DELETED":
                                watched.store.pop(_key(obj), None)
                            elif event["type"] != "BOOKMARK":
                                watched.store[_key(obj)] = obj
                        notify()
                        if stop.is_set():
                            return
            except Exception as error:  # any failure: list again, after a pause, so the fleet is never stale
                logger.warning("watching %s failed, listing again: %s", watched.plural, error)
                stop.wait(RELIST_BACKOFF_SECONDS)


@dataclass
class _Watch:
    """One resource in one namespace (None: all), and what the cluster holds of it."""

    group: str
    version: str
    plural: str
    label_selector: str | None
    namespace: str | None
    store: dict[ObjectKey, Mapping[str, Any]] = field(default_factory=dict)
    synced: threading.Event = field(default_factory=threading.Event)
