"""What every service loop of one operator process shares: API access, HTTP session, options, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvfleet.operator.dispatch import PriorityDispatcher, Urgency
from kvfleet.operator.held_requests import HeldRequestWatch
from kvfleet.operator.kube import KubeApi, KubeError
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.operator.render import RenderOptions
from kvfleet.operator.scrape import DEFAULT_MAX_PAGE_BYTES, GatewayQueues

logger = logging.getLogger(__name__)

# How often to look again whether the cluster serves ServiceMonitors (prometheus-operator installed later).
CAPABILITY_REFRESH_SECONDS = 300.0

ServiceKey = tuple[str, str]
# The children that create pods: applied before the others.
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "LeaderWorkerSet"})


class AsyncCluster:
    """The service loops' API calls, shared by all of them through one dispatcher, Deployments first."""

    def __init__(self, kube: KubeApi, dispatcher: PriorityDispatcher) -> None:
        self._kube = kube
        self._dispatcher = dispatcher

    async def apply(self, manifest: Mapping[str, Any]) -> None:
        urgency = Urgency.DEPLOYMENT if manifest["kind"] in WORKLOAD_KINDS else Urgency.CHILD
        await self._dispatcher.call(urgency, functools.partial(self._kube.apply, manifest))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        delete = functools.partial(self._kube.delete, api_version, kind, namespace, name)
        await self._dispatcher.call(Urgency.CHILD, delete)

    async def delete_pods(self, namespace: str, labels: Mapping[str, str]) -> None:
        await self._dispatcher.call(
            Urgency.CHILD, functools.partial(self._kube.delete_pods, namespace, labels)
        )

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        patch = functools.partial(self._kube.patch_status, namespace, name, status)
        await self._dispatcher.call(Urgency.STATUS, patch)

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        read = functools.partial(self._kube.secret_value, namespace, name, key)
        return await self._dispatcher.call(Urgency.CHILD, read)

    async def secret_labels(self, namespace: str, name: str) -> Mapping[str, str]:
        read = functools.partial(self._kube.secret_labels, namespace, name)
        return await self._dispatcher.call(Urgency.CHILD, read)


@dataclass
class OperatorContext:
    kube: KubeApi
    render_options: RenderOptions
    scrape_timeout_seconds: float = 1.5
    scrape_max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES
    api_concurrency: int = 32
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    session: aiohttp.ClientSession | None = None
    capability_task: asyncio.Task[None] | None = None
    gateway_queues: GatewayQueues | None = None
    held_watch: HeldRequestWatch | None = None
    held_watch_task: asyncio.Task[None] | None = None
    dispatcher: PriorityDispatcher = field(init=False)
    cluster: AsyncCluster = field(init=False)
    _wakeups: dict[ServiceKey, asyncio.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dispatcher = PriorityDispatcher(self.api_concurrency)
        self.metrics.watch_dispatcher(self.dispatcher)
        self.cluster = AsyncCluster(self.kube, self.dispatcher)

    def wakeup_for(self, key: ServiceKey) -> asyncio.Event:
        return self._wakeups.setdefault(key, asyncio.Event())

    def wake(self, key: ServiceKey) -> None:
        event = self._wakeups.get(key)
        if event is not None:
            event.set()

    def forget(self, key: ServiceKey) -> None:
        self._wakeups.pop(key, None)
        self.metrics.forget(*key)

    async def refresh_capabilities(self) -> None:
        try:
            serves = await asyncio.to_thread(self.kube.serves, "monitoring.coreos.com/v1", "servicemonitors")
        except KubeError as error:
            logger.warning("could not check for the ServiceMonitor API: %s", error)
            return
        if serves != self.render_options.service_monitor:
            logger.info("ServiceMonitor API %s", "found: rendering ServiceMonitors" if serves else "absent")
            self.render_options = dataclasses.replace(self.render_options, service_monitor=serves)

    async def watch_capabilities(self) -> None:
        while True:
            await self.refresh_capabilities()
            await asyncio.sleep(CAPABILITY_REFRESH_SECONDS)
