"""One InferenceService's control loop: render and apply, scrape and scale, report status and events.

A single loop per service is the only writer of its children and status, so the autoscaler and
spec changes never race. It is level-triggered: every pass recomputes everything from the live
object and the watched pods and Deployment, and is woken early by any change to them.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvfleet.contract.kv_transfer import ROLES, Role
from kvfleet.operator.adapters import AdapterStatus, AdapterSync, DesiredAdapter
from kvfleet.operator.api import API_KEY_ENV, GROUP_LABEL, HTTP_PORT, SERVICE_LABEL, qualified_name
from kvfleet.operator.autoscaler import (
    AutoscalerState,
    FleetState,
    Latency,
    MetricsSample,
    PodMetrics,
    ScaleDecision,
    Waits,
    aggregate,
    decide,
    sizing,
)
from kvfleet.operator.kube import ChildNotOwned, KubeError
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.operator.observed import DeploymentView, Observed, PodView, StatefulSetView
from kvfleet.operator.render import (
    LWS_API_VERSION,
    Owner,
    RenderOptions,
    Replicas,
    render_children,
    replica_selector,
    service_url,
)
from kvfleet.operator.render_pod import adapter_source
from kvfleet.operator.safety import (
    GUARD_UNAVAILABLE_REASON,
    GuardState,
    check_guardrails_served,
    check_loosening,
    guard_service,
)
from kvfleet.operator.scrape import GatewayQueue, ScrapeFailure, ScrapeTarget
from kvfleet.operator.secret_refs import check_labelled, secret_references, unreadable
from kvfleet.operator.sleepers import Sleepers
from kvfleet.operator.spec import (
    InferenceServiceSpec,
    SpecError,
    group_name,
    parse_spec,
    rendezvous_name,
    role_name,
)
from kvfleet.operator.status import (
    NAME_CONFLICT_REASON,
    Condition,
    GroupStatus,
    Observation,
    RoleObservation,
    build_status,
    name_conflict_condition,
    transition_events,
)

logger = logging.getLogger(__name__)

# Re-apply unchanged children this often, undoing edits made behind the operator's back.
RESYNC_SECONDS = 300.0
# Without autoscaling, pass at least this often; watch events wake the loop sooner.
IDLE_PASS_SECONDS = 30.0
# Autoscaler figures alone refresh the status at most this often (they change on every scrape).
STATUS_REFRESH_SECONDS = 15.0
MAX_BACKOFF_SECONDS = 300.0
# The Warning event posted while replicas answer /metrics with more than the operator reads.
PAGE_TOO_LARGE_REASON = "MetricsPageTooLarge"
# How long a service's API key, read from its Secret to load adapters, and the labels of the Secrets it
# names are reused: a rotated key, or a Secret's label removed, is seen within it.
API_KEY_REFRESH_SECONDS = 60.0
# The condition reason while an object of a child's name belongs to something else.
CHILD_NOT_OWNED_REASON = "ChildNotOwned"
# Status keys the operator writes only sometimes; a merge patch must clear them explicitly.
_OPTIONAL_STATUS_KEYS = (
    "autoscaler",
    "lastScaleTime",
    "lastScaleReason",
    "adapters",
    "safety",
    "groups",
    "roles",
)


class Cluster(Protocol):
    async def apply(self, manifest: Mapping[str, Any]) -> None: ...

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    async def delete_pods(self, namespace: str, labels: Mapping[str, str]) -> None: ...

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None: ...

    async def secret_labels(self, namespace: str, name: str) -> Mapping[str, str]: ...


class Scraper(Protocol):
    async def scrape(self, targets: Sequence[ScrapeTarget]) -> list[PodMetrics | ScrapeFailure]: ...


# (type, reason, message) -> posted as a Kubernetes Event on the InferenceService.
EventSink = Callable[[str, str, str], None]
# A model's name in the fleet gateway (kvfleet.operator.api.qualified_name) -> its queue there; None when no
# gateway answers.
GatewayQueueOf = Callable[[str], Awaitable[GatewayQueue | None]]
# A served model name -> the InferenceService of the same namespace that owns it (claim_order); None when no
# service is known to serve it.
NameOwnerOf = Callable[[str], str | None]
# The name of an InferenceService of the same namespace -> whether it can serve as a guard.
GuardStateOf = Callable[[str], GuardState]


def _guard_unknown(service: str) -> GuardState:
    return GuardState.NOT_FOUND


async def _no_gateway(model: str) -> GatewayQueue | None:
    return None


# Asks for the loop to be woken while the gateway holds requests for this model (None: no longer).
HeldWatch = Callable[[str | None], None]


def _watch_nothing(model: str | None) -> None:
    pass


def _no_claimant_known(served_name: str) -> str | None:
    return None


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass
class RoleScaling:
    """One role of a disaggregated service: its replica count and what its autoscaler remembers."""

    desired: int | None = None
    samples: list[MetricsSample] = field(default_factory=list)
    state: AutoscalerState = field(default_factory=AutoscalerState)
    panic: bool = False
    unreachable: Latency | None = None


def _role_scalings() -> dict[Role, RoleScaling]:
    return {role: RoleScaling() for role in ROLES}


@dataclass(frozen=True)
class _Sized:
    """The replicas the workload should run, and how what runs stands against them."""

    replicas: Replicas
    # The colocated workload, read as a Deployment; None for a disaggregated service.
    deployment: DeploymentView | None
    # A workload object is missing or runs another count.
    drifted: bool
    # No workload object exists yet.
    new: bool


@dataclass
class ServiceController:
    owner: Owner
    cluster: Cluster
    scraper: Scraper
    events: EventSink
    metrics: OperatorMetrics
    options: Callable[[], RenderOptions]
    adapter_sync: AdapterSync
    gateway_queue: GatewayQueueOf = _no_gateway
    guard_state: GuardStateOf = _guard_unknown
    name_owner: NameOwnerOf = _no_claimant_known
    watch_held: HeldWatch = _watch_nothing
    # Puts replicas to sleep and wakes them (spec.scaling.sleepingReplicas); None: never asked to.
    sleepers: Sleepers | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], datetime.datetime] = _utc_now

    desired: int | None = None
    samples: list[MetricsSample] = field(default_factory=list)
    autoscaler_state: AutoscalerState = field(default_factory=AutoscalerState)
    panic: bool = False
    unreachable: Latency | None = None
    last_scale_time: str | None = None
    last_scale_reason: str | None = None
    # A disaggregated service's roles; the fields above are then unused.
    roles: dict[Role, RoleScaling] = field(default_factory=_role_scalings)
    # (template digest, replicas) last applied.
    _applied: tuple[str, Replicas] | None = None
    _template: tuple[tuple[int, RenderOptions], str] | None = None
    _last_apply_at: float = float("-inf")
    _last_scrape_at: float = float("-inf")
    # The gateways' queue of the service's model at the previous scrape, for the share refused since.
    _gateway_queue: GatewayQueue | None = None
    # No replica is awake and the autoscaler may start one: a pass is due whenever the gateway holds requests.
    _at_zero: bool = False
    _last_status: dict[str, Any] | None = None
    _last_status_at: float = float("-inf")
    _failures: int = 0
    _warned: dict[str, str] = field(default_factory=dict)
    # (Secret name, when read, its key).
    _api_key: tuple[str, float, str | None] | None = None
    # Secret name -> (when read, its labels).
    _secret_labels: dict[str, tuple[float, Mapping[str, str]]] = field(default_factory=dict)
    # (StatefulSet, revision) of the groups whose pods were deleted to start them on that revision.
    _restarted: set[tuple[str, str]] = field(default_factory=set)

    async def run(
        self,
        body: Mapping[str, Any],
        observe: Callable[[], Observed],
        wakeup: asyncio.Event,
        stopped: Callable[[], bool],
    ) -> None:
        """Passes until stopped; `body` is the live object, `observe` reads the watch indexes."""
        while not stopped():
            wakeup.clear()
            try:
                delay = await self.reconcile(body, observe())
            except Exception:
                # A bug must not kill the loop: log it, count it, back off, try again.
                logger.exception("reconcile of %s/%s failed", self.owner.namespace, self.owner.name)
                self.metrics.reconciles.labels("error").inc()
                self.metrics.reconcile_errors.labels("unexpected").inc()
                self._failures += 1
                delay = min(2.0**self._failures, MAX_BACKOFF_SECONDS)
            try:
                async with asyncio.timeout(delay):
                    await wakeup.wait()
                # Changes come in bursts (a rollout touches many pods): take them in one pass.
                await asyncio.sleep(0.1)
            except TimeoutError:
                pass

    async def reconcile(self, body: Mapping[str, Any], observed: Observed) -> float:
        """One pass; returns the seconds until the next one is due."""
        started = self.clock()
        try:
            delay = await self._reconcile(body, observed)
        finally:
            self.metrics.reconcile_seconds.observe(self.clock() - started)
        return delay

    async def _reconcile(self, body: Mapping[str, Any], observed: Observed) -> float:
        pods = observed.pods
        deployment = observed.deployment
        meta = body.get("metadata", {})
        generation = meta.get("generation", 0)
        previous_status = self._last_status or dict(body.get("status") or {})
        try:
            spec = parse_spec(body.get("spec") or {}, name=self.owner.name)
            check_loosening(self.options().safety, spec.safety)
            check_guardrails_served(self.options().safety, spec)
            await self._check_secrets(spec)
        except SpecError as error:
            self.metrics.reconciles.labels("invalid").inc()
            self._warn(error.reason, error.message)
            observation = self._observation(generation, None, deployment, pods, (error.reason, error.message))
            await self._write_status(observation, previous_status)
            return IDLE_PASS_SECONDS

        sized = await self._scale(spec, observed, previous_status)
        blocking = None
        try:
            await self._apply(spec, generation, sized)
            await self._remove_other_workloads(spec, observed)
            await self._restart_outdated_groups(spec, observed)
            self._failures = 0
            self._resolve("ReconcileFailed")
            self._resolve(CHILD_NOT_OWNED_REASON)
            self.metrics.reconciles.labels("success").inc()
        except ChildNotOwned as error:
            self._failures += 1
            blocking = (CHILD_NOT_OWNED_REASON, error.message)
            self._warn(CHILD_NOT_OWNED_REASON, error.message)
            self.metrics.reconciles.labels("error").inc()
            self.metrics.reconcile_errors.labels("child_not_owned").inc()
        except KubeError as error:
            self._failures += 1
            message = f"applying the children failed: {error.message}"
            blocking = ("ReconcileFailed", message)
            self._warn("ReconcileFailed", message)
            self.metrics.reconciles.labels("error").inc()
            self.metrics.reconcile_errors.labels(f"http_{error.status}").inc()

        adapters = await self._sync_adapters(spec, pods) if spec.lora_enabled else None
        observation = self._observation(
            generation,
            spec,
            sized.deployment,
            pods,
            blocking,
            adapters=adapters,
            guard=self._guard(spec),
            groups=self._group_statuses(spec, pods) if spec.grouped else None,
            name_conflict=self._name_conflict(spec),
            roles=self._role_observations(spec, observed) if spec.disaggregation is not None else None,
        )
        await self._write_status(observation, previous_status)
        if self._failures:
            return min(2.0**self._failures, MAX_BACKOFF_SECONDS)
        return float(spec.scaling.metrics_interval_seconds) if _autoscaled(spec) else IDLE_PASS_SECONDS

    async def _scale(
        self, spec: InferenceServiceSpec, observed: Observed, previous_status: Mapping[str, Any]
    ) -> _Sized:
        """The replicas the workload should run after this pass's autoscaling, against what runs."""
        if spec.disaggregation is None:
            # For a model that spans nodes, the workload is the groups, read as a Deployment of groups.
            deployment = _workload(spec, observed, applied=self._applied is not None)
            self.roles = _role_scalings()
            self._size_colocated(spec, deployment, previous_status)
            if spec.scaling.autoscaling:
                await self._autoscale(spec, observed.pods)
            self._watch_held(spec, spec.scaling.autoscaling and self.desired == 0)
            started = spec.scaling.started(self.desired or 0)
            drifted = deployment is None or deployment.replicas != started
            return _Sized(started, deployment, drifted, new=deployment is None)
        self.desired = None
        self._size_roles(spec, observed, previous_status)
        await self._autoscale_roles(spec, observed.pods)
        decode = spec.disaggregation.role("decode").scaling
        self._watch_held(spec, decode.autoscaling and self.roles["decode"].desired == 0)
        replicas = {role: self.roles[role].desired or 0 for role in ROLES}
        drifted = any(
            observed.roles.get(role) is None or observed.roles[role].replicas != count
            for role, count in replicas.items()
        )
        return _Sized(replicas, None, drifted, new=not observed.roles)

    def _size_colocated(
        self,
        spec: InferenceServiceSpec,
        deployment: DeploymentView | None,
        previous_status: Mapping[str, Any],
    ) -> None:
        if self.desired is None:
            known = deployment.replicas if deployment else previous_status.get("desiredReplicas")
            if spec.scaling.sleeping_replicas and isinstance(previous_status.get("desiredReplicas"), int):
                known = previous_status["desiredReplicas"]  # the workload runs the sleepers as well
            # A new service starts with a replica even when it may scale to zero: it proves the model loads.
            initial = known if isinstance(known, int) else max(spec.scaling.min_replicas, 1)
            self.desired = spec.scaling.clamp(initial)
        self.desired = spec.scaling.clamp(self.desired)

    def _size_roles(
        self, spec: InferenceServiceSpec, observed: Observed, previous_status: Mapping[str, Any]
    ) -> None:
        """Each role's count: what runs, or what the status last said, or at least one to start with."""
        reported = previous_status.get("roles") or {}
        for role in ROLES:
            scaled, policy = self.roles[role], sizing(spec, role).policy
            if scaled.desired is None:
                view = observed.roles.get(role)
                known = view.replicas if view else (reported.get(role) or {}).get("desiredReplicas")
                initial = known if isinstance(known, int) else max(policy.min_replicas, 1)
                scaled.desired = initial
            scaled.desired = policy.clamp(scaled.desired)

    async def _autoscale(self, spec: InferenceServiceSpec, pods: list[PodView]) -> None:
        scaling = spec.scaling
        scraped = await self._scrape(spec, pods)
        if scraped is None:
            return
        now, by_pod, held, refused_share, waits = scraped
        assert self.desired is not None
        reports = list(by_pod.values())
        sample = aggregate(now, reports, len(reports), held or 0.0, refused_share, waits)
        if sample is None and not reports and scaling.min_replicas == 0 and held is not None:
            # No replica to ask (at zero, or the first one starting): the gateway's queue is the demand.
            sample = MetricsSample(time=now, queue_depth=held, reporting_pods=0, held=held)
        if sample is not None:
            self.samples.append(sample)
            self.metrics.queue_depth.labels(self.owner.namespace, self.owner.name).set(sample.queue_depth)
        self.samples = [s for s in self.samples if now - s.time < scaling.stable_window_seconds]
        fleet = FleetState(self.desired, len(reports), _unschedulable(pods))
        fit = sizing(spec)
        decision = decide(
            scaling, self.samples, fleet, self.autoscaler_state, now, fit.latency, fit.targets, fit.slo
        )
        self.autoscaler_state, self.panic = decision.state, decision.panic
        self.unreachable = decision.unreachable
        self.desired = self._scaled(self.desired, decision)
        if scaling.sleeping_replicas:
            await self._keep_sleepers(spec, pods, by_pod, held)

    async def _keep_sleepers(
        self,
        spec: InferenceServiceSpec,
        pods: list[PodView],
        reports: Mapping[PodView, PodMetrics | None],
        held: float | None,
    ) -> None:
        """Wakes sleepers while fewer replicas are awake than wanted, puts idle ones to sleep while more."""
        if self.sleepers is None:
            return
        try:
            api_key = await self._read_api_key(spec.engine.api_key_secret)
        except KubeError:
            return  # the Secret could not be read: the next pass tries again
        assert self.desired is not None
        done = await self.sleepers.keep(self.desired, pods, reports, held, api_key)
        for pod in done.woken:
            self.events("Normal", "ReplicaWoken", f"Woke {pod} from sleep: {self.desired} wanted awake")
        for pod in done.slept:
            self.events("Normal", "ReplicaAsleep", f"Put {pod} to sleep: {self.desired} wanted awake")
        if done.problems:
            logger.warning("%s/%s: %s", self.owner.namespace, self.owner.name, "; ".join(done.problems))

    async def _autoscale_roles(self, spec: InferenceServiceSpec, pods: list[PodView]) -> None:
        """Scales each autoscaled role on its own figures. While no prefill replica is ready, the decode
        replicas compute every prompt: their backlog is the prefill role's demand."""
        assert spec.disaggregation is not None
        if not _autoscaled(spec):
            return
        scraped = await self._scrape(spec, pods)
        if scraped is None:
            return
        now, reports, held, refused_share, waits = scraped
        by_role = {role: [r for pod, r in reports.items() if pod.role == role] for role in ROLES}
        decode = aggregate(now, by_role["decode"], len(by_role["decode"]), held or 0.0, refused_share, waits)
        decode_policy = sizing(spec, "decode").policy
        if decode is None and not by_role["decode"] and decode_policy.min_replicas == 0 and held is not None:
            decode = MetricsSample(time=now, queue_depth=held, reporting_pods=0, held=held)
        # Without prefill replicas ready, the decode role's figures stand for the prefill role's demand.
        prefill = by_role["prefill"] or by_role["decode"]
        samples: dict[Role, MetricsSample | None] = {
            "prefill": aggregate(now, prefill, len(prefill), refused_share=refused_share),
            "decode": decode,
        }
        if decode is not None:
            self.metrics.queue_depth.labels(self.owner.namespace, self.owner.name).set(decode.queue_depth)
        for role in ROLES:
            if spec.disaggregation.role(role).scaling.autoscaling:
                self._autoscale_role(spec, role, samples[role], by_role[role], pods, now)

    def _autoscale_role(
        self,
        spec: InferenceServiceSpec,
        role: Role,
        sample: MetricsSample | None,
        reports: list[PodMetrics | None],
        pods: list[PodView],
        now: float,
    ) -> None:
        scaled, fit = self.roles[role], sizing(spec, role)
        assert scaled.desired is not None
        if sample is not None:
            scaled.samples.append(sample)
        scaled.samples = [s for s in scaled.samples if now - s.time < fit.policy.stable_window_seconds]
        role_pods = [pod for pod in pods if pod.role == role]
        fleet = FleetState(scaled.desired, len(reports), _unschedulable(role_pods))
        decision = decide(
            fit.policy, scaled.samples, fleet, scaled.state, now, fit.latency, fit.targets, fit.slo
        )
        scaled.state, scaled.panic = decision.state, decision.panic
        scaled.unreachable = decision.unreachable
        scaled.desired = self._scaled(scaled.desired, decision, role)

    def _watch_held(self, spec: InferenceServiceSpec, at_zero: bool) -> None:
        """At zero, requests the gateway holds wake the loop at once instead of at its next scrape."""
        self._at_zero = at_zero
        self.watch_held(qualified_name(self.owner.namespace, spec.model.served_name) if at_zero else None)

    async def _scrape(
        self, spec: InferenceServiceSpec, pods: list[PodView]
    ) -> tuple[float, dict[PodView, PodMetrics | None], float | None, float, Waits] | None:
        """Once per metrics interval, and at every pass at zero (the held requests' watch woke it): each
        ready replica's report (None where it gave none), the requests the gateway holds for the service
        (None when no gateway answered), the share of its requests since the previous scrape that it refused,
        and those that waited in its queue; None between intervals."""
        now = self.clock()
        if now - self._last_scrape_at < spec.scaling.metrics_interval_seconds and not self._at_zero:
            return None
        self._last_scrape_at = now
        scraped = [pod for pod in pods if pod.scrapeable and pod.ip]
        targets = [ScrapeTarget(pod.name, pod.ip, HTTP_PORT) for pod in scraped if pod.ip]
        results = await self.scraper.scrape(targets) if targets else []
        reports = {
            pod: result if isinstance(result, PodMetrics) else None
            for pod, result in zip(scraped, results, strict=True)
        }
        failed = list(reports.values()).count(None)
        if failed:
            self.metrics.scrape_failures.labels(self.owner.namespace, self.owner.name).inc(failed)
        too_large = [
            target.pod
            for target, result in zip(targets, results, strict=True)
            if result is ScrapeFailure.PAGE_TOO_LARGE
        ]
        self._report_pages_too_large(too_large)
        # Its own queue: the gateway counts each service's requests under its namespace-qualified name.
        queue = await self.gateway_queue(qualified_name(self.owner.namespace, spec.model.served_name))
        if queue is None:
            self._gateway_queue = None
            return now, reports, None, 0.0, Waits()
        refused_share = queue.refused_share_since(self._gateway_queue)
        waits = queue.waits_since(self._gateway_queue)
        self._gateway_queue = queue
        return now, reports, queue.held, refused_share, waits

    def _scaled(self, current: int, decision: ScaleDecision, role: Role | None = None) -> int:
        """The decision's count, announced when it changes the current one."""
        if decision.replicas != current:
            direction = "up" if decision.replicas > current else "down"
            which = f"{role} " if role is not None else ""
            message = f"Scaled {which}from {current} to {decision.replicas}: {decision.reason}"
            self.events("Normal", "ScaledUp" if direction == "up" else "ScaledDown", message)
            self.metrics.scale_events.labels(self.owner.namespace, self.owner.name, direction).inc()
            self.last_scale_time = _timestamp(self.wall_clock())
            self.last_scale_reason = f"{role}: {decision.reason}" if role is not None else decision.reason
        return decision.replicas

    async def _sync_adapters(self, spec: InferenceServiceSpec, pods: list[PodView]) -> list[AdapterStatus]:
        desired = [DesiredAdapter(adapter.name, adapter_source(adapter)) for adapter in spec.adapters]
        try:
            api_key = await self._read_api_key(spec.engine.api_key_secret)
        except KubeError as error:
            message = f"cannot read the API key from Secret {spec.engine.api_key_secret}: {error.message}"
            return [AdapterStatus(adapter.name, "Failed", 0, message) for adapter in desired]
        targets = [ScrapeTarget(pod.name, pod.ip, HTTP_PORT) for pod in pods if pod.scrapeable and pod.ip]
        return await self.adapter_sync.sync(
            desired, targets, api_key, update=spec.engine.allow_runtime_lora_updates
        )

    async def _check_secrets(self, spec: InferenceServiceSpec) -> None:
        """Raises SpecError for the first Secret the spec names that is not labelled for kvfleet."""
        namespace = self.owner.namespace
        references = secret_references(spec)
        named = {reference.name for reference in references}
        self._secret_labels = {name: read for name, read in self._secret_labels.items() if name in named}
        for reference in references:
            try:
                labels = await self._labels_of(reference.name)
            except KubeError as error:
                raise unreadable(reference, namespace, error.message) from None
            check_labelled(reference, namespace, labels)

    async def _labels_of(self, secret: str) -> Mapping[str, str]:
        now = self.clock()
        cached = self._secret_labels.get(secret)
        if cached is None or now - cached[0] >= API_KEY_REFRESH_SECONDS:
            labels = await self.cluster.secret_labels(self.owner.namespace, secret)
            self._secret_labels[secret] = cached = (now, labels)
        return cached[1]

    async def _read_api_key(self, secret: str | None) -> str | None:
        if secret is None:
            return None
        now = self.clock()
        cached = self._api_key
        if cached is None or cached[0] != secret or now - cached[1] >= API_KEY_REFRESH_SECONDS:
            value = await self.cluster.secret_value(self.owner.namespace, secret, API_KEY_ENV)
            self._api_key = cached = (secret, now, value)
        return cached[2]

    def _report_pages_too_large(self, pods: list[str]) -> None:
        if not pods:
            self._resolve(PAGE_TOO_LARGE_REASON)
            return
        self.metrics.scrape_pages_too_large.labels(self.owner.namespace, self.owner.name).inc(len(pods))
        message = (
            "/metrics pages over the operator's byte cap (--scrape-max-bytes) from "
            f"{', '.join(sorted(pods))}: counted as failed scrapes, read no further than the cap"
        )
        if self._warn(PAGE_TOO_LARGE_REASON, message):
            logger.warning("%s/%s: %s", self.owner.namespace, self.owner.name, message)

    async def _apply(self, spec: InferenceServiceSpec, generation: int, sized: _Sized) -> None:
        """Applies the children unless they were applied as they are now, nothing drifted from them and the
        resync is not due."""
        options = self.options()
        spec_digest = self._template_digest(spec, generation, options)
        now = self.clock()
        fresh = now - self._last_apply_at < RESYNC_SECONDS
        replicas = sized.replicas
        if self._applied == (spec_digest, replicas) and not sized.drifted and fresh:
            return
        children = render_children(self.owner, spec, replicas, options)
        for child in children:
            await self.cluster.apply(child)
            self.metrics.applies.labels(child["kind"]).inc()
        kinds = ", ".join(child["kind"] for child in children)
        if sized.new and self._applied is None:
            self.events("Normal", "Created", f"Applied {kinds} for {spec.model.uri}")
        elif self._applied is not None and spec_digest != self._applied[0]:
            self.events("Normal", "Updated", f"Applied generation {generation}: rolling out the new template")
            self.autoscaler_state = self.autoscaler_state.for_a_new_template()
            for scaled in self.roles.values():
                scaled.state = scaled.state.for_a_new_template()
        self._applied, self._last_apply_at = (spec_digest, replicas), now

    def _template_digest(self, spec: InferenceServiceSpec, generation: int, options: RenderOptions) -> str:
        """What the children would be at any replica count (one replica: a group is a child of its own);
        rendered once per generation and options."""
        key = (generation, options)
        if self._template is None or self._template[0] != key:
            one: Replicas = 1 if spec.disaggregation is None else dict.fromkeys(ROLES, 1)
            self._template = key, _digest(render_children(self.owner, spec, one, options))
        return self._template[1]

    async def _remove_other_workloads(self, spec: InferenceServiceSpec, observed: Observed) -> None:
        """Deletes what no longer serves the spec: groups above the desired count (scaling down), and the
        workload of another shape after the model moved between one pod and groups, or between backends, or
        the service between colocated and disaggregated."""
        namespace = self.owner.namespace
        stateful_sets = spec.grouped and spec.scaling.group_backend == "statefulset"
        leader_worker_set = spec.grouped and spec.scaling.group_backend == "leaderworkerset"
        for view in observed.stateful_sets:
            if not stateful_sets or view.group is None or view.group >= (self.desired or 0):
                await self.cluster.delete("apps/v1", "StatefulSet", namespace, view.name)
        colocated = spec.disaggregation is None and not spec.grouped
        if not colocated and observed.deployment is not None:
            await self.cluster.delete("apps/v1", "Deployment", namespace, self.owner.name)
        if spec.disaggregation is None:
            for role in observed.roles:
                await self.cluster.delete(
                    "apps/v1", "Deployment", namespace, role_name(self.owner.name, role)
                )
        if not leader_worker_set and observed.leader_worker_set is not None:
            await self.cluster.delete(
                LWS_API_VERSION, "LeaderWorkerSet", namespace, rendezvous_name(self.owner.name)
            )

    async def _restart_outdated_groups(self, spec: InferenceServiceSpec, observed: Observed) -> None:
        """Starts groups on a new template by deleting their pods together (their StatefulSets wait for
        that: OnDelete). A group that is not serving goes at once; a serving one only while every other
        group serves, so that one group at most is down for the rollout."""
        if not spec.grouped or spec.scaling.group_backend != "statefulset":
            return
        assert self.desired is not None
        current = [
            view for view in observed.stateful_sets if view.group is not None and view.group < self.desired
        ]
        serving = {view.name for view in current if _group_serving(view, observed.pods)}
        for view in sorted(current, key=lambda view: view.group or 0):
            seen = view.observed_generation >= view.generation
            if not seen or (view.name, view.update_revision) in self._restarted:
                continue
            if not _group_outdated(view, observed.pods):
                continue
            if view.name in serving and len(serving) < len(current):
                continue
            await self.cluster.delete_pods(
                self.owner.namespace, {SERVICE_LABEL: self.owner.name, GROUP_LABEL: str(view.group)}
            )
            self._restarted.add((view.name, view.update_revision))
            self.events("Normal", "GroupRestarted", f"Restarting group {view.name} on the current template")
            serving.discard(view.name)

    def _group_statuses(self, spec: InferenceServiceSpec, pods: list[PodView]) -> list[GroupStatus]:
        assert self.desired is not None
        statuses = []
        for index in range(self.desired):
            members = [pod for pod in pods if pod.group == index and not pod.terminating]
            statuses.append(
                GroupStatus(
                    name=group_name(self.owner.name, spec.scaling.group_backend, index),
                    ranks=spec.resources.nodes,
                    ranks_ready=sum(1 for pod in members if pod.ready),
                )
            )
        return statuses

    def _guard(self, spec: InferenceServiceSpec) -> tuple[str, GuardState] | None:
        """The guard service and its state; a Warning event while it cannot serve, a Normal one once it
        can again."""
        service = guard_service(self.options().safety, spec.safety)
        if service is None:
            self._resolve(GUARD_UNAVAILABLE_REASON)
            return None
        state = self.guard_state(service)
        if state is GuardState.READY:
            if GUARD_UNAVAILABLE_REASON in self._warned:
                self.events("Normal", "GuardAvailable", f"the guard service {service!r} serves again")
            self._resolve(GUARD_UNAVAILABLE_REASON)
        else:
            self._warn(
                GUARD_UNAVAILABLE_REASON,
                f"the guard service {service!r} is {state.value}: checks that need it fail open or closed as "
                "spec.safety.guard.failOpen says",
            )
        return service, state

    def _name_conflict(self, spec: InferenceServiceSpec) -> Condition | None:
        """The NameConflict condition while another service of the namespace owns the served name (the gateway
        then routes this one nowhere), announced once."""
        owner = self.name_owner(spec.model.served_name)
        if owner is None or owner == self.owner.name:
            self._resolve(NAME_CONFLICT_REASON)
            return None
        condition = name_conflict_condition(spec.model.served_name, owner)
        self._warn(NAME_CONFLICT_REASON, condition.message)
        return condition

    def _observation(
        self,
        generation: int,
        spec: InferenceServiceSpec | None,
        deployment: DeploymentView | None,
        pods: list[PodView],
        blocking: tuple[str, str] | None,
        adapters: list[AdapterStatus] | None = None,
        guard: tuple[str, GuardState] | None = None,
        groups: list[GroupStatus] | None = None,
        name_conflict: Condition | None = None,
        roles: list[RoleObservation] | None = None,
    ) -> Observation:
        series = (self.owner.namespace, self.owner.name)
        if deployment is not None:
            self.metrics.ready_replicas.labels(*series).set(deployment.ready_replicas)
        desired = self.desired if self.desired is not None else (deployment.replicas if deployment else 0)
        if roles is not None:
            ready = sum(role.deployment.ready_replicas for role in roles if role.deployment is not None)
            self.metrics.ready_replicas.labels(*series).set(ready)
            desired = sum(role.desired_replicas for role in roles)
        self.metrics.desired_replicas.labels(*series).set(desired)
        autoscaling = spec.scaling.autoscaling if spec is not None else False
        recent = self.samples[-1] if self.samples else None
        return Observation(
            generation=generation,
            url=service_url(self.owner, self.options()),
            selector=replica_selector(self.owner.name, spec),
            autoscaling=autoscaling,
            desired_replicas=desired,
            deployment=deployment,
            pods=[pod for pod in pods if not pod.terminating],
            gpu_resource_name=spec.resources.gpu_resource_name if spec else "nvidia.com/gpu",
            blocking_error=blocking,
            latest_sample=recent,
            panic=self.panic,
            unreachable=self.unreachable,
            last_scale_time=self.last_scale_time,
            last_scale_reason=self.last_scale_reason,
            adapters=adapters,
            guard=(guard[0], guard[1].value) if guard is not None else None,
            groups=groups,
            name_conflict=name_conflict,
            roles=roles,
        )

    def _role_observations(self, spec: InferenceServiceSpec, observed: Observed) -> list[RoleObservation]:
        assert spec.disaggregation is not None
        observations = []
        for role in ROLES:
            scaled = self.roles[role]
            section = spec.disaggregation.role(role)
            observations.append(
                RoleObservation(
                    role=role,
                    autoscaling=section.scaling.autoscaling,
                    desired_replicas=scaled.desired or 0,
                    deployment=observed.roles.get(role),
                    gpu_resource_name=(section.resources or spec.resources).gpu_resource_name,
                    latest_sample=scaled.samples[-1] if scaled.samples else None,
                    panic=scaled.panic,
                    unreachable=scaled.unreachable,
                )
            )
        return observations

    async def _write_status(self, observation: Observation, previous: Mapping[str, Any]) -> None:
        status = build_status(observation, previous, self.wall_clock())
        now = self.clock()
        if status == previous:
            return
        only_figures = _without_figures(status) == _without_figures(previous)
        if only_figures and now - self._last_status_at < STATUS_REFRESH_SECONDS:
            return
        patch: dict[str, Any] = dict(status)
        for key in _OPTIONAL_STATUS_KEYS:
            if key in previous and key not in status:
                patch[key] = None
        if "roles" in status:
            patch["roles"] = _roles_patch(status["roles"], previous.get("roles") or {})
        try:
            await self.cluster.patch_status(self.owner.namespace, self.owner.name, patch)
        except KubeError as error:
            # The object may be gone (deletion races the loop); the next pass retries otherwise.
            logger.warning("status of %s/%s not written: %s", self.owner.namespace, self.owner.name, error)
            return
        changes = transition_events(previous.get("conditions") or [], status["conditions"])
        for event_type, reason, message in changes:
            self.events(event_type, reason, message)
        self._last_status, self._last_status_at = status, now

    def _warn(self, reason: str, message: str) -> bool:
        """Posts a Warning event; False when the same one was posted last (it would flood the stream)."""
        if self._warned.get(reason) == message:
            return False
        self._warned[reason] = message
        self.events("Warning", reason, message)
        return True

    def _resolve(self, reason: str) -> None:
        self._warned.pop(reason, None)


def _workload(spec: InferenceServiceSpec, observed: Observed, applied: bool) -> DeploymentView | None:
    """The service's workload as a Deployment of replicas: the Deployment itself, the LeaderWorkerSet, or
    the group StatefulSets summed up (a group counts as ready when every rank is). `applied`: whether this
    loop applied the children, after which no StatefulSet means zero groups rather than none created yet."""
    if not spec.grouped:
        return observed.deployment
    if spec.scaling.group_backend == "leaderworkerset":
        return observed.leader_worker_set
    groups = [view for view in observed.stateful_sets if view.group is not None]
    if not groups:
        return DeploymentView(1, 1, 0, 0, 0, 0, 0) if applied else None
    ready = sum(1 for view in groups if view.ready_replicas >= view.replicas)
    seen = all(view.observed_generation >= view.generation for view in groups)
    return DeploymentView(
        generation=1,
        observed_generation=1 if seen else 0,
        replicas=len(groups),
        status_replicas=len(groups),
        updated_replicas=sum(1 for view in groups if view.rolled_out),
        ready_replicas=ready,
        available_replicas=ready,
    )


def _group_outdated(view: StatefulSetView, pods: list[PodView]) -> bool:
    """Whether a pod of the group runs an older template. Not merely fewer pods on the current one than
    ranks: a lost rank's pod, terminating or not yet recreated, comes back on the current template by
    itself, and its group restarts through the runtime (the other ranks exit), not through the operator."""
    return any(
        pod.group == view.group and not pod.terminating and pod.revision != view.update_revision
        for pod in pods
    )


def _group_serving(view: StatefulSetView, pods: list[PodView]) -> bool:
    ready = [pod for pod in pods if pod.group == view.group and pod.ready and not pod.terminating]
    return len(ready) >= view.replicas


def _digest(children: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(children, sort_keys=True).encode()).hexdigest()


def _timestamp(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without_figures(status: Mapping[str, Any]) -> dict[str, Any]:
    figureless = {key: value for key, value in status.items() if key != "autoscaler"}
    if "roles" in status:
        figureless["roles"] = {role: _without_figures(counts) for role, counts in status["roles"].items()}
    return figureless


def _roles_patch(roles: Mapping[str, Any], previous: Mapping[str, Any]) -> dict[str, Any]:
    """The roles' status as a merge patch: a role's figures written before and not now are cleared (a merge
    patch keeps what it does not name)."""
    patch = {}
    for role, counts in roles.items():
        cleared = "autoscaler" in (previous.get(role) or {}) and "autoscaler" not in counts
        patch[role] = {**counts, "autoscaler": None} if cleared else dict(counts)
    return patch


def _autoscaled(spec: InferenceServiceSpec) -> bool:
    """Whether the autoscaler sizes the service, or one of its roles."""
    if spec.disaggregation is None:
        return spec.scaling.autoscaling
    return any(spec.disaggregation.role(role).scaling.autoscaling for role in ROLES)


def _unschedulable(pods: list[PodView]) -> int:
    return sum(1 for pod in pods if pod.unschedulable_message and not pod.terminating)
