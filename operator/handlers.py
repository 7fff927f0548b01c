"""kopf registrations: thin glue between watch events and the per-service control loops.

- Indexes keep compact views of the managed pods and Deployments (no API calls per pass).
- Any change to an InferenceService, its pods or its Deployment wakes that service's loop.
- One daemon per InferenceService runs its ServiceController; kopf stops it when the object is
  deleted and when peering pauses this replica in favour of another (leader election).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.operator.adapters import AdapterSync, RuntimeAdapterClient
from kvfleet.operator.api import (
    FIELD_MANAGER,
    GATEWAY_COMPONENT,
    GROUP,
    HTTP_PORT_NAME,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    PLURAL,
    SERVICE_LABEL,
    VERSION,
    claim_order,
)
from kvfleet.operator.context import OperatorContext
from kvfleet.operator.controller import ServiceController
from kvfleet.operator.held_requests import POLL_SECONDS, HeldRequestWatch
from kvfleet.operator.kube import connection_info
from kvfleet.operator.observed import (
    DeploymentView,
    Observed,
    PodView,
    StatefulSetView,
    deployment_view,
    leader_worker_set_view,
    pod_view,
    stateful_set_view,
)
from kvfleet.operator.render import Owner
from kvfleet.operator.safety import GuardState
from kvfleet.operator.scrape import FleetScraper, GatewayQueue, GatewayQueues, ScrapeTarget
from kvfleet.operator.sleepers import RuntimeSleepClient, Sleepers
from kvfleet.operator.spec import SpecError, parse_spec

MANAGED = {LABEL_MANAGED_BY: MANAGED_BY, SERVICE_LABEL: kopf.PRESENT}
# The chart's fleet gateway pods, whose queues the autoscaler reads.
GATEWAY_PODS = {LABEL_NAME: "kvfleet", LABEL_COMPONENT: GATEWAY_COMPONENT}
FINALIZER = f"{GROUP}/fleet-loop"


def _context(memo: kopf.Memo) -> OperatorContext:
    return memo["kvfleet"]


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    context = _context(memo)
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.networking.request_timeout = 60
    context.session = aiohttp.ClientSession(headers={"User-Agent": FIELD_MANAGER})
    # One read of the gateways serves every loop, and the held requests' watch, for a poll's time.
    context.gateway_queues = GatewayQueues(
        context.session, context.scrape_timeout_seconds, context.scrape_max_page_bytes, POLL_SECONDS
    )
    context.held_watch = HeldRequestWatch(context.gateway_queues.read)
    context.held_watch_task = asyncio.create_task(context.held_watch.run(), name="kvfleet-held-requests")
    context.capability_task = asyncio.create_task(context.watch_capabilities(), name="kvfleet-capabilities")


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    # The credentials the operator's own calls use (kubeconfig, context or service account).
    return connection_info(_context(memo).kube.configuration)


@kopf.on.cleanup()
async def shut_down(memo: kopf.Memo, **_: Any) -> None:
    context = _context(memo)
    if context.capability_task is not None:
        context.capability_task.cancel()
    if context.held_watch_task is not None:
        context.held_watch_task.cancel()
    if context.session is not None:
        await context.session.close()
    context.dispatcher.close()


# Handlers are coroutines although they never wait: kopf runs plain functions in a thread, a hop per event.
@kopf.index("pods", labels=MANAGED)
async def kvfleet_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, PodView]:
    return {(namespace, labels[SERVICE_LABEL]): pod_view(body)}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
async def kvfleet_deployments(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, DeploymentView]:
    return {(namespace, labels[SERVICE_LABEL]): deployment_view(body)}


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
async def kvfleet_stateful_sets(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, StatefulSetView]:
    return {(namespace, labels[SERVICE_LABEL]): stateful_set_view(body)}


# Watched only where the LeaderWorkerSet API is installed; kopf leaves a resource the cluster lacks unwatched.
@kopf.index("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=MANAGED)
async def kvfleet_leader_worker_sets(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, DeploymentView]:
    return {(namespace, labels[SERVICE_LABEL]): leader_worker_set_view(body)}


@kopf.index("pods", labels=GATEWAY_PODS)
async def kvfleet_gateways(name: str, body: kopf.Body, **_: Any) -> dict[Any, ScrapeTarget]:
    view = pod_view(body)
    containers = body.get("spec", {}).get("containers", [])
    ports = [p for c in containers for p in c.get("ports", []) if p.get("name") == HTTP_PORT_NAME]
    if not view.scrapeable or not ports or view.ip is None:
        return {}
    return {GATEWAY_COMPONENT: ScrapeTarget(name, view.ip, ports[0]["containerPort"])}


# Who claims which served name in each namespace, for the owner of each name (claim_order).
@kopf.index(GROUP, VERSION, PLURAL)
async def kvfleet_served_names(
    namespace: str, name: str, body: kopf.Body, **_: Any
) -> dict[Any, tuple[str, str]]:
    try:
        served = parse_spec(body.get("spec") or {}, name=name).model.served_name
    except SpecError:
        return {}  # not routed, so it claims nothing
    return {(namespace, served): claim_order(body.get("metadata") or {})}


@kopf.on.event("pods", labels=MANAGED)
@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=MANAGED)
async def wake_owner(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _context(memo).wake((namespace, labels[SERVICE_LABEL]))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def wake_service(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    _context(memo).wake((namespace, name))


@dataclass(frozen=True)
class _IndexedCluster:
    """What one service's loop reads of the cluster: kopf's indexes, kept by the watches (no API calls)."""

    namespace: str
    name: str
    uid: str
    pods: kopf.Index[Any, PodView]
    deployments: kopf.Index[Any, DeploymentView]
    stateful_sets: kopf.Index[Any, StatefulSetView]
    leader_worker_sets: kopf.Index[Any, DeploymentView]
    gateways: kopf.Index[Any, ScrapeTarget]
    served_names: kopf.Index[Any, tuple[str, str]]
    gateway_queues: GatewayQueues

    def observe(self) -> Observed:
        key = (self.namespace, self.name)
        # Objects left by a deleted namesake must not count.
        deployments = [view for view in self.deployments.get(key, []) if view.owner_uid == self.uid]
        colocated = [view for view in deployments if view.role is None]
        group_sets = [view for view in self.leader_worker_sets.get(key, []) if view.owner_uid == self.uid]
        return Observed(
            deployment=colocated[0] if colocated else None,
            pods=list(self.pods.get(key, [])),
            stateful_sets=tuple(
                view for view in self.stateful_sets.get(key, []) if view.owner_uid == self.uid
            ),
            leader_worker_set=group_sets[0] if group_sets else None,
            roles={view.role: view for view in deployments if view.role in ROLES},
        )

    def gateway_targets(self) -> list[ScrapeTarget]:
        return list(self.gateways.get(GATEWAY_COMPONENT, []))

    async def gateway_queue(self, model: str) -> GatewayQueue | None:
        targets = self.gateway_targets()
        queues = await self.gateway_queues.read(targets) if targets else None
        return None if queues is None else queues.get(model, GatewayQueue())

    def guard_state(self, service: str) -> GuardState:
        guard = (self.namespace, service)
        # A disaggregated guard serves through its decode role; its prefill role answers no one alone.
        deployments = [view for view in self.deployments.get(guard, []) if view.role != "prefill"]
        views = [*deployments, *self.leader_worker_sets.get(guard, [])]
        groups = list(self.stateful_sets.get(guard, []))
        if not views and not groups:
            return GuardState.NOT_FOUND
        serving = any(view.ready_replicas > 0 for view in views) or any(
            group.ready_replicas >= group.replicas for group in groups
        )
        return GuardState.READY if serving else GuardState.UNAVAILABLE

    def name_owner(self, served_name: str) -> str | None:
        claims = list(self.served_names.get((self.namespace, served_name), []))
        return min(claims)[1] if claims else None


# The loop exits by itself once `stopped` is set; the backoff gives it that chance before kopf cancels it.
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=2.0, cancellation_timeout=10.0)
async def fleet_loop(
    body: kopf.Body,
    namespace: str,
    name: str,
    uid: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    kvfleet_pods: kopf.Index[Any, PodView],
    kvfleet_deployments: kopf.Index[Any, DeploymentView],
    kvfleet_stateful_sets: kopf.Index[Any, StatefulSetView],
    kvfleet_leader_worker_sets: kopf.Index[Any, DeploymentView],
    kvfleet_gateways: kopf.Index[Any, ScrapeTarget],
    kvfleet_served_names: kopf.Index[Any, tuple[str, str]],
    **_: Any,
) -> None:
    context = _context(memo)
    key = (namespace, name)
    assert context.session is not None, "the startup handler creates the session"
    assert context.gateway_queues is not None, "the startup handler creates it"
    indexed = _IndexedCluster(
        namespace=namespace,
        name=name,
        uid=uid,
        pods=kvfleet_pods,
        deployments=kvfleet_deployments,
        stateful_sets=kvfleet_stateful_sets,
        leader_worker_sets=kvfleet_leader_worker_sets,
        gateways=kvfleet_gateways,
        served_names=kvfleet_served_names,
        gateway_queues=context.gateway_queues,
    )

    def post_event(event_type: str, reason: str, message: str) -> None:
        kopf.event(body, type=event_type, reason=reason, message=message)

    wakeup = context.wakeup_for(key)
    held_watch = context.held_watch
    assert held_watch is not None, "the startup handler creates it"

    def watch_held(model: str | None) -> None:
        held_watch.watch(key, model, wakeup, indexed.gateway_targets)

    controller = ServiceController(
        owner=Owner(name, namespace, uid),
        cluster=context.cluster,
        scraper=FleetScraper(context.session, context.scrape_timeout_seconds, context.scrape_max_page_bytes),
        events=post_event,
        metrics=context.metrics,
        options=lambda: context.render_options,
        adapter_sync=AdapterSync(RuntimeAdapterClient(context.session)),
        sleepers=Sleepers(RuntimeSleepClient(context.session)),
        gateway_queue=indexed.gateway_queue,
        watch_held=watch_held,
        guard_state=indexed.guard_state,
        name_owner=indexed.name_owner,
    )

    async def wake_when_stopped() -> None:
        await stopped.wait()
        wakeup.set()

    # Deletion and peering pauses set `stopped`; the loop must notice at once, not at its next pass.
    stop_watch = asyncio.create_task(wake_when_stopped(), name=f"kvfleet-stop-{namespace}/{name}")
    try:
        await controller.run(body, indexed.observe, wakeup, lambda: bool(stopped))
    finally:
        stop_watch.cancel()
        watch_held(None)
        context.forget(key)
