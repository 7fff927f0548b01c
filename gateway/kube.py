"""Discovery from the cluster: InferenceServices and their replicas' pods.

The gateway reads the pods themselves, as the Gateway API inference extension's endpoint picker does, not
the EndpointSlices of the services' Services: a pod's readiness is seen as soon as the kubelet reports it,
without an endpoints controller in between, and the pod's name travels with its address. Each resource is
listed, then watched from the list's resourceVersion, on the event loop (kvfleet.gateway.kube_watch). Every
change republishes the fleet, computed by the pure `model_configs` from the objects as they are.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp
from kubernetes import client
from kvfleet.contract.engine import preempts
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.contract.tiers import TIERS
from kvfleet.gateway.discovery import ClientKey, ModelConfig, Publish
from kvfleet.gateway.kube_watch import ApiError, ApiServer, ObjectKey, ObjectWatch, connect, object_key
from kvfleet.operator.api import (
    API_KEY_ENV,
    GROUP,
    HTTP_PORT_NAME,
    PLURAL,
    ROLE_LABEL,
    SERVICE_LABEL,
    VERSION,
    claim_order,
    qualified_name,
    serves_api,
)
from kvfleet.operator.spec import SpecError, parse_spec

logger = logging.getLogger(__name__)

# The services' API keys are read again this often (a rotated key is honoured within it), and the fleet
# republished.
KEY_REFRESH_SECONDS = 60.0


def model_configs(
    services: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    defaults: ModelConfig,
    keys: Mapping[ObjectKey, ClientKey] | None = None,
) -> dict[str, ModelConfig]:
    """The fleet as the gateway routes it: one entry per service, under its qualified name
    (`NAMESPACE/SERVED_NAME`), with its ready replicas (a disaggregated service's by role; a pod of a role
    the gateway does not know is not routed).

    `keys` holds the API keys read from the services' Secrets, by (namespace, Secret name). Of the services of
    one namespace serving the same name, the one that `claim_order` puts first owns it; the others are not
    routed (their operator reports the conflict).
    """
    # A disaggregated service's pods carry their role: its prefill replicas are routed apart, and its decode
    # replicas as the replicas of any other service.
    endpoints: dict[ObjectKey, list[str]] = {}
    prefill_endpoints: dict[ObjectKey, list[str]] = {}
    not_ready: dict[ObjectKey, list[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        service = labels.get(SERVICE_LABEL)
        url = _url(pod)
        role = labels.get(ROLE_LABEL)
        # Of a group spanning nodes, only rank 0 serves the API.
        if service is None or url is None or not serves_api(labels) or role not in (None, *ROLES):
            continue
        by_role = prefill_endpoints if role == "prefill" else endpoints
        if not _is_ready(pod):
            by_role = not_ready  # loading, or asleep
        by_role.setdefault((meta.get("namespace", ""), service), []).append(url)
    models: dict[str, ModelConfig] = {}
    owners: dict[str, str] = {}
    for service in sorted(
        services, key=lambda service: (object_key(service)[0], claim_order(_meta(service)))
    ):
        key = object_key(service)
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
        sleepers = not_ready.get(key, ()) if scaling.sleeping_replicas else ()
        models[routed] = dataclasses.replace(
            defaults,
            name=routed,
            namespace=namespace,
            served_name=served,
            endpoints=tuple(sorted(set(endpoints.get(key, ())))),
            prefill_endpoints=tuple(sorted(set(prefill_endpoints.get(key, ())))),
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
            sleeping_endpoints=tuple(sorted(set(sleepers))),
            replicas_resume=spec.engine.runtime == "kvfleet",
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
            found.add((object_key(service)[0], secret))
    return found


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _is_ready(pod: Mapping[str, Any]) -> bool:
    return any(
        condition.get("type") == "Ready" and condition.get("status") == "True"
        for condition in (pod.get("status") or {}).get("conditions") or []
    )


def _url(pod: Mapping[str, Any]) -> str | None:
    """The replica's base URL while it has an address and is not terminating; None otherwise."""
    address = (pod.get("status") or {}).get("podIP")
    if not address or (pod.get("metadata") or {}).get("deletionTimestamp"):
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
        self, configuration: client.Configuration, namespaces: Sequence[str], defaults: ModelConfig
    ) -> None:
        self._configuration = configuration
        # (namespace, Secret name) -> (when read, the key).
        self._keys: dict[ObjectKey, tuple[float, ClientKey]] = {}
        self._namespaces: Sequence[str | None] = list(namespaces) or [None]
        self._defaults = defaults

    async def run(self, publish: Publish) -> None:
        changed = asyncio.Event()
        services = [
            ObjectWatch(_collection(GROUP, VERSION, PLURAL, namespace)) for namespace in self._namespaces
        ]
        pods = [
            ObjectWatch(_collection("", "v1", "pods", namespace), SERVICE_LABEL)
            for namespace in self._namespaces
        ]
        async with connect(self._configuration) as api, asyncio.TaskGroup() as watches:
            for watched in [*services, *pods]:
                watches.create_task(
                    watched.run(api, changed.set), name=f"kvfleet-gateway-watch {watched.path}"
                )
            while True:
                await _woken(changed, KEY_REFRESH_SECONDS)
                if all(watched.synced for watched in [*services, *pods]):
                    publish(await self._fleet(api, services, pods))

    async def _fleet(
        self, api: ApiServer, services: Sequence[ObjectWatch], pods: Sequence[ObjectWatch]
    ) -> dict[str, ModelConfig]:
        objects = [obj for watched in services for obj in watched.store.values()]
        replicas = [obj for watched in pods for obj in watched.store.values()]
        keys = await self._read_keys(api, key_secrets(objects))
        return model_configs(objects, replicas, self._defaults, keys)

    async def _read_keys(self, api: ApiServer, secrets: set[ObjectKey]) -> dict[ObjectKey, ClientKey]:
        """The API keys of the given Secrets, each read again once it is KEY_REFRESH_SECONDS old."""
        now = time.monotonic()
        self._keys = {secret: read for secret, read in self._keys.items() if secret in secrets}
        for namespace, name in secrets - {
            s for s, (at, _) in self._keys.items() if now - at < KEY_REFRESH_SECONDS
        }:
            self._keys[(namespace, name)] = (now, await _read_key(api, namespace, name))
        return {secret: key for secret, (_, key) in self._keys.items()}


async def _woken(changed: asyncio.Event, seconds: float) -> None:
    """Waits for a change, or `seconds` at most (the API keys are read again then)."""
    # Not asyncio.wait_for: before Python 3.12 it returns a wait that ended in the step its task was
    # cancelled in, and the cancellation is lost (the discovery never stops).
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await changed.wait()
    changed.clear()


async def _read_key(api: ApiServer, namespace: str, name: str) -> ClientKey:
    try:
        secret = await api.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
    except (ApiError, aiohttp.ClientError, TimeoutError) as error:
        # Refused rather than open until it can be read.
        logger.warning("cannot read the API key Secret %s/%s: %s", namespace, name, error)
        return ClientKey(None)
    value = (secret.get("data") or {}).get(API_KEY_ENV)
    return ClientKey(hashlib.sha256(base64.b64decode(value)).digest() if value else None)


def _collection(group: str, version: str, plural: str, namespace: str | None) -> str:
    """The API path of a resource's objects in one namespace, or in all (None)."""
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    return f"{prefix}/{plural}" if namespace is None else f"{prefix}/namespaces/{namespace}/{plural}"
