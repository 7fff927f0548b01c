"""The per-service control loop against a recording fake cluster, scraper and clock."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from kvfleet.contract.kv_transfer import Role
from kvfleet.operator import controller as controller_module
from kvfleet.operator import handlers
from kvfleet.operator.adapters import AdapterLoadError, AdapterSync, DesiredAdapter, ReplicaUnavailable
from kvfleet.operator.api import GROUP_LABEL, SERVICE_LABEL
from kvfleet.operator.autoscaler import AutoscalerState, PodMetrics, Waits
from kvfleet.operator.controller import IDLE_PASS_SECONDS, ServiceController
from kvfleet.operator.kube import ChildNotOwned, KubeError
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.operator.observed import DeploymentView, Observed, PodView, StatefulSetView
from kvfleet.operator.render import Owner, RenderOptions, render_children
from kvfleet.operator.safety import GuardState, SafetyPlatform
from kvfleet.operator.scrape import GatewayQueue, ScrapeFailure, ScrapeTarget
from kvfleet.operator.secret_refs import SECRET_LABEL
from kvfleet.runtime.lora.request import source_digest

UID = "uid-1"
FOR_KVFLEET = {SECRET_LABEL: "true"}


@dataclass
class FakeCluster:
    applied: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    fail_with: KubeError | None = None
    # (namespace, name, key) -> value; None: reading Secrets is forbidden.
    secrets: dict[tuple[str, str, str], str] | None = field(default_factory=dict)
    secret_reads: int = 0
    # (namespace, name) -> labels, of the Secrets that exist.
    secret_labels_by_name: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    # (kind, name) of deleted objects; the label sets of deleted pods.
    deleted: list[tuple[str, str]] = field(default_factory=list)
    deleted_pods: list[dict[str, str]] = field(default_factory=list)

    async def apply(self, manifest: Mapping[str, Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.applied.append(copy.deepcopy(dict(manifest)))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.deleted.append((kind, name))

    async def delete_pods(self, namespace: str, labels: Mapping[str, str]) -> None:
        self.deleted_pods.append(dict(labels))

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.statuses.append(copy.deepcopy(dict(status)))

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        self.secret_reads += 1
        if self.secrets is None:
            raise KubeError(403, "secrets is forbidden")
        return self.secrets.get((namespace, name, key))

    async def secret_labels(self, namespace: str, name: str) -> Mapping[str, str]:
        labels = self.secret_labels_by_name.get((namespace, name))
        if labels is None:
            raise KubeError(404, f'secrets "{name}" not found')
        return labels


@dataclass
class FakeScraper:
    per_pod: PodMetrics | ScrapeFailure = ScrapeFailure.NO_ANSWER
    # Outcomes of particular pods, by name; the others get per_pod.
    by_pod: dict[str, PodMetrics | ScrapeFailure] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)

    async def scrape(self, targets: Sequence[ScrapeTarget]) -> list[PodMetrics | ScrapeFailure]:
        self.calls.append([target.url for target in targets])
        return [self.by_pod.get(target.pod, self.per_pod) for target in targets]


@dataclass
class FakeReplicas:
    """Replicas' adapters by pod, as the runtime's API would report and change them."""

    served_by_pod: dict[str, dict[str, str]] = field(default_factory=dict)
    # Source -> the runtime's reason for refusing it.
    refuse: dict[str, str] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    calls: list[tuple[str, str, str, str | None]] = field(default_factory=list)

    async def served(self, target: ScrapeTarget, api_key: str | None) -> dict[str, str]:
        if target.pod in self.silent:
            raise ReplicaUnavailable(f"{target.pod}: /v1/models did not answer")
        return {
            name: source_digest(source) for name, source in self.served_by_pod.get(target.pod, {}).items()
        }

    async def load(self, target: ScrapeTarget, adapter: DesiredAdapter, api_key: str | None) -> None:
        self.calls.append(("load", target.pod, adapter.name, api_key))
        if adapter.source in self.refuse:
            raise AdapterLoadError(self.refuse[adapter.source])
        self.served_by_pod.setdefault(target.pod, {})[adapter.name] = adapter.source

    async def unload(self, target: ScrapeTarget, name: str, api_key: str | None) -> None:
        self.calls.append(("unload", target.pod, name, api_key))
        self.served_by_pod.get(target.pod, {}).pop(name, None)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    body: dict[str, Any]
    cluster: FakeCluster = field(default_factory=FakeCluster)
    scraper: FakeScraper = field(default_factory=FakeScraper)
    replicas: FakeReplicas = field(default_factory=FakeReplicas)
    clock: Clock = field(default_factory=Clock)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    controller: ServiceController = field(init=False)

    def __post_init__(self) -> None:
        self.controller = self.new_controller()

    def new_controller(self) -> ServiceController:
        return ServiceController(
            owner=Owner("svc", "ns", UID),
            cluster=self.cluster,
            scraper=self.scraper,
            events=lambda *event: self.events.append(event),
            metrics=self.metrics,
            options=lambda: RenderOptions(),
            adapter_sync=AdapterSync(self.replicas, clock=self.clock),
            clock=self.clock,
            wall_clock=lambda: (
                datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
                + datetime.timedelta(seconds=self.clock.now)
            ),
        )

    def run(
        self,
        deployment: DeploymentView | None = None,
        pods: list[PodView] | None = None,
        stateful_sets: tuple[StatefulSetView, ...] = (),
        roles: dict[Role, DeploymentView] | None = None,
    ) -> float:
        observed = Observed(deployment, pods or [], stateful_sets, roles=roles or {})
        delay = asyncio.run(self.controller.reconcile(self.body, observed))
        if self.cluster.statuses:
            self.body["status"] = {k: v for k, v in self.cluster.statuses[-1].items() if v is not None}
        return delay

    def deployments(self) -> list[dict[str, Any]]:
        return [m for m in self.cluster.applied if m["kind"] == "Deployment"]

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]


def service(**spec: Any) -> dict[str, Any]:
    base = {"model": {"uri": "file:///models/tiny"}, "resources": {"gpus": 0}}
    return {
        "metadata": {"name": "svc", "namespace": "ns", "uid": UID, "generation": 1},
        "spec": {**base, **spec},
    }


def deployment_at(replicas: int, ready: int | None = None, generation: int = 1) -> DeploymentView:
    ready = replicas if ready is None else ready
    return DeploymentView(generation, generation, replicas, replicas, replicas, ready, ready, owner_uid=UID)


def ready_pods(count: int) -> list[PodView]:
    return [PodView(f"svc-{i}", f"127.1.0.{i + 1}", True, False) for i in range(count)]


def test_first_pass_creates_children_and_reports() -> None:
    harness = Harness(service())
    delay = harness.run()
    assert [m["kind"] for m in harness.cluster.applied] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert harness.deployments()[0]["spec"]["replicas"] == 1
    assert harness.reasons() == ["Created"]
    status = harness.cluster.statuses[-1]
    assert status["observedGeneration"] == 1 and status["desiredReplicas"] == 1
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "DeploymentPending")
    assert delay == 2.0, "autoscaled services pass at the metrics interval"


def test_unchanged_passes_write_nothing_and_render_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    renders: list[int] = []

    def counting_render(*args: Any) -> list[dict[str, Any]]:
        renders.append(args[2])  # the replica count
        return render_children(*args)

    monkeypatch.setattr(controller_module, "render_children", counting_render)
    harness = Harness(service())
    harness.run()
    harness.run(deployment_at(1), ready_pods(1))
    applies, statuses, rendered = len(harness.cluster.applied), len(harness.cluster.statuses), len(renders)
    assert harness.reasons() == ["Created", "Ready"]
    for _ in range(5):
        harness.clock.now += 1
        harness.run(deployment_at(1), ready_pods(1))
    assert len(harness.cluster.applied) == applies, "idempotent: nothing re-applied"
    assert len(harness.cluster.statuses) == statuses, "idempotent: status unchanged"
    assert len(renders) == rendered == 2, "rendered once to compare, once to apply; never again unchanged"


def test_spec_change_rolls_out_and_drift_is_undone() -> None:
    harness = Harness(service())
    harness.run()
    harness.run(deployment_at(1), ready_pods(1))
    harness.body["spec"]["engine"] = {"maxNumSeqs": 8}
    harness.body["metadata"]["generation"] = 2
    harness.run(deployment_at(1), ready_pods(1))
    assert "--max-num-seqs" in harness.deployments()[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert harness.reasons()[-1] == "Updated"
    applied = len(harness.cluster.applied)
    harness.run(deployment_at(5, generation=2), ready_pods(1))
    assert len(harness.cluster.applied) == applied + 3, "someone scaled the Deployment: re-applied"
    assert harness.deployments()[-1]["spec"]["replicas"] == 1


REMEMBERED = AutoscalerState(
    recommendations=((990.0, 3),),
    full_throughput=(("time to first token", 2000.0),),
    proven_throughput=(("time to first token", 1500.0),),
)


@pytest.mark.parametrize("disaggregation", [None, {"decode": {"scaling": {"minReplicas": 2}}}])
def test_a_new_template_forgets_what_the_old_replicas_were_measured_to_serve(
    disaggregation: dict[str, Any] | None,
) -> None:
    """The throughput remembered past the stable window is the old template's: another engine setting may
    serve more or less. A change of the scaling alone keeps it, and the recent recommendations always."""
    harness = Harness(service(disaggregation=disaggregation) if disaggregation else service())
    harness.run()
    controller = harness.controller

    def remembered(state: AutoscalerState | None = None) -> list[AutoscalerState]:
        """The autoscaler states in use (each role's, or the service's), set to `state` first if given."""
        if disaggregation is None:
            controller.autoscaler_state = state or controller.autoscaler_state
            return [controller.autoscaler_state]
        for scaled in controller.roles.values():
            scaled.state = state or scaled.state
        return [scaled.state for scaled in controller.roles.values()]

    count = len(remembered(REMEMBERED))
    harness.body["spec"]["scaling"] = {"maxReplicas": 9}
    harness.body["metadata"]["generation"] = 2
    harness.run()
    assert remembered() == [REMEMBERED] * count
    harness.body["spec"]["engine"] = {"maxNumSeqs": 8}
    harness.body["metadata"]["generation"] = 3
    harness.run()
    assert harness.reasons()[-1] == "Updated"
    assert remembered() == [AutoscalerState(recommendations=REMEMBERED.recommendations)] * count


def test_invalid_spec_is_reported_once_and_never_rendered() -> None:
    harness = Harness(service(model={"uri": "hf://no-org"}))
    for _ in range(3):
        assert harness.run() == IDLE_PASS_SECONDS
    assert harness.cluster.applied == []
    assert harness.events == [
        (
            "Warning",
            "InvalidModelURI",
            "spec.model.uri 'hf://no-org': expected hf://<org>/<name>[@<revision>]",
        )
    ]
    ready = next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidModelURI")


def test_apply_failures_back_off_and_recover() -> None:
    harness = Harness(service())
    harness.cluster.fail_with = KubeError(403, "deployments.apps is forbidden")
    delays = [harness.run() for _ in range(3)]
    assert delays == [2.0, 4.0, 8.0]
    assert harness.reasons() == ["ReconcileFailed"], "one event per distinct failure"
    ready = next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ReconcileFailed" and "forbidden" in ready["message"]
    harness.cluster.fail_with = None
    assert harness.run() == 2.0
    assert len(harness.deployments()) == 1


def test_load_scales_up_with_an_event_and_status() -> None:
    harness = Harness(service(scaling={"targetQueueDepth": 4, "maxReplicas": 6}))
    harness.run()
    harness.scraper.per_pod = PodMetrics(waiting=10, running=4)
    harness.clock.now += 2
    harness.run(deployment_at(1), ready_pods(1))
    assert harness.scraper.calls[-1] == ["http://127.1.0.1:8000/metrics"]
    assert harness.deployments()[-1]["spec"]["replicas"] == 4
    scaled = next(event for event in harness.events if event[1] == "ScaledUp")
    assert scaled[0] == "Normal" and scaled[2].startswith("Scaled from 1 to 4: panic: queue depth 14.0")
    status = harness.cluster.statuses[-1]
    assert status["desiredReplicas"] == 4 and status["lastScaleReason"].startswith("panic")
    assert status["autoscaler"]["queueDepth"] == 14.0 and status["autoscaler"]["panic"] is True
    assert harness.metrics.desired_replicas.labels("ns", "svc")._value.get() == 4


def test_the_shares_the_gateway_refused_and_held_between_scrapes_reach_the_autoscaler() -> None:
    harness = Harness(service(scaling={"targetQueueDepth": 4, "maxReplicas": 6}))
    harness.scraper.per_pod = PodMetrics(waiting=0, running=2)
    readings = iter(
        [
            GatewayQueue(routed=100, refused=0, waited=5),
            GatewayQueue(held=1, routed=130, refused=10, waited=11),
        ]
    )

    async def gateway_queue(model: str) -> GatewayQueue | None:
        return next(readings)

    harness.controller.gateway_queue = gateway_queue
    for _ in range(2):
        harness.clock.now += 2
        harness.run(deployment_at(1), ready_pods(1))
    # The first reading has nothing before it; between the two, 30 were routed and 10 refused, and 6 of the
    # 40 waited in the gateway's queue.
    shares = [(sample.refused_share, sample.waits) for sample in harness.controller.samples]
    assert shares == [(0.0, Waits()), (0.25, Waits(arrived=40, waited=6))]
    assert harness.controller.samples[-1].held == 1


def test_pages_over_the_cap_are_failed_scrapes_announced_once() -> None:
    harness = Harness(service(scaling={"targetQueueDepth": 4, "maxReplicas": 6}))
    harness.scraper.per_pod = PodMetrics(waiting=2, running=2)
    harness.scraper.by_pod = {"svc-1": ScrapeFailure.PAGE_TOO_LARGE, "svc-2": ScrapeFailure.PAGE_TOO_LARGE}
    for _ in range(3):
        harness.clock.now += 2
        harness.run(deployment_at(3), ready_pods(3))
    registry = harness.metrics.registry
    series = {"namespace": "ns", "name": "svc"}
    assert registry.get_sample_value("kvfleet_operator_scrape_failures_total", series) == 6
    assert registry.get_sample_value("kvfleet_operator_scrape_pages_too_large_total", series) == 6
    warnings = [event for event in harness.events if event[1] == "MetricsPageTooLarge"]
    assert warnings == [
        (
            "Warning",
            "MetricsPageTooLarge",
            "/metrics pages over the operator's byte cap (--scrape-max-bytes) from svc-1, svc-2: counted as "
            "failed scrapes, read no further than the cap",
        )
    ], "posted once while the same pods stay over the cap"
    status = harness.cluster.statuses[-1]
    assert status["autoscaler"]["reportingPods"] == 1, "only the replica that answered within the cap"
    # Once the pages fit again the warning is cleared, so a later relapse is announced anew.
    harness.scraper.by_pod = {}
    harness.clock.now += 2
    harness.run(deployment_at(3), ready_pods(3))
    harness.scraper.by_pod = {"svc-1": ScrapeFailure.PAGE_TOO_LARGE, "svc-2": ScrapeFailure.PAGE_TOO_LARGE}
    harness.clock.now += 2
    harness.run(deployment_at(3), ready_pods(3))
    assert harness.reasons().count("MetricsPageTooLarge") == 2


def test_pods_that_cannot_report_are_not_scraped() -> None:
    harness = Harness(service())
    pods = [
        PodView("a", "127.1.0.1", False, False),
        PodView("b", None, False, False),
        PodView("c", "127.1.0.3", True, True),
        PodView("d", "127.1.0.4", True, False),
    ]
    harness.run(deployment_at(4, ready=1), pods)
    assert harness.scraper.calls == [["http://127.1.0.4:8000/metrics"]]


def test_fixed_replicas_never_scrape() -> None:
    harness = Harness(service(scaling={"replicas": 3}))
    assert harness.run() == IDLE_PASS_SECONDS
    harness.run(deployment_at(3), ready_pods(3))
    assert harness.scraper.calls == []
    assert harness.deployments()[-1]["spec"]["replicas"] == 3


def test_restart_keeps_the_current_replica_count() -> None:
    harness = Harness(service(scaling={"maxReplicas": 8}))
    harness.run(deployment_at(5), ready_pods(5))
    assert harness.deployments()[-1]["spec"]["replicas"] == 5
    assert "Created" not in harness.reasons(), "an existing Deployment is adopted, not announced"


def test_figures_alone_refresh_the_status_at_most_every_15_seconds() -> None:
    harness = Harness(service(scaling={"targetQueueDepth": 100}))
    harness.run(deployment_at(1), ready_pods(1))
    written = len(harness.cluster.statuses)
    for depth in range(1, 6):
        harness.scraper.per_pod = PodMetrics(waiting=0, running=depth)
        harness.clock.now += 2
        harness.run(deployment_at(1), ready_pods(1))
    assert len(harness.cluster.statuses) == written + 1, "first figures change the condition, the rest wait"
    harness.clock.now += 16
    harness.scraper.per_pod = PodMetrics(waiting=0, running=9)
    harness.run(deployment_at(1), ready_pods(1))
    assert len(harness.cluster.statuses) == written + 2


def test_insufficient_gpu_is_announced_once() -> None:
    harness = Harness(service())
    harness.run()
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    pending = PodView("svc-x", None, False, False, unschedulable_message=message)
    for _ in range(3):
        harness.run(deployment_at(1, ready=0), [pending])
    assert harness.reasons().count("InsufficientGPU") == 1


def test_unexpected_errors_do_not_end_the_loop() -> None:
    harness = Harness(service())
    calls = {"count": 0}

    def broken_observe() -> Observed:
        calls["count"] += 1
        wakeup.set()  # skip the back-off wait; the loop must still come round
        if calls["count"] >= 2:
            stop.set()
        return Observed(None, [PodView("weird", "not-an-ip", True, False)])

    stop = asyncio.Event()
    wakeup = asyncio.Event()

    async def scenario() -> None:
        await asyncio.wait_for(harness.controller.run(harness.body, broken_observe, wakeup, stop.is_set), 10)

    asyncio.run(scenario())
    assert calls["count"] == 2
    assert harness.metrics.reconcile_errors.labels("unexpected")._value.get() >= 1


@pytest.mark.parametrize("tier", ["critical", "batch"])
def test_tier_reaches_the_pods(tier: str) -> None:
    harness = Harness(service(sla={"tier": tier}))
    harness.run()
    pod = harness.deployments()[-1]["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == f"kvfleet-{tier}"


def test_requests_held_by_the_gateway_scale_a_fleet_at_zero_to_one() -> None:
    harness = Harness(
        service(scaling={"minReplicas": 0}, model={"uri": "file:///models/tiny", "servedName": "m"})
    )
    # Another namespace's service of the same served name has requests held: they are not this one's.
    held = {"ns/m": 0.0, "elsewhere/m": 5.0}
    asked: list[str] = []

    async def gateway_queue(model: str) -> GatewayQueue | None:
        asked.append(model)
        return GatewayQueue(held=held.get(model, 0.0))

    harness.controller.gateway_queue = gateway_queue
    harness.run(deployment_at(0), [])
    assert harness.deployments()[-1]["spec"]["replicas"] == 0 and asked == ["ns/m"]
    ready = next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    held["ns/m"] = 2.0
    harness.clock.now += 2
    harness.run(deployment_at(0), [])
    assert harness.deployments()[-1]["spec"]["replicas"] == 1
    assert any(reason == "ScaledUp" for reason in harness.reasons())
    assert harness.scraper.calls == [], "nothing to scrape at zero"


def test_a_fleet_at_zero_asks_to_be_woken_by_held_requests_and_scales_on_the_wake() -> None:
    harness = Harness(
        service(scaling={"minReplicas": 0}, model={"uri": "file:///models/tiny", "servedName": "m"})
    )
    held = {"ns/m": 0.0}
    watched: list[str | None] = []

    async def gateway_queue(model: str) -> GatewayQueue | None:
        return GatewayQueue(held=held[model])

    harness.controller.gateway_queue = gateway_queue
    harness.controller.watch_held = watched.append
    harness.run(deployment_at(0), [])
    assert harness.deployments()[-1]["spec"]["replicas"] == 0 and watched[-1] == "ns/m"
    # The watch wakes the loop a moment later, well within the metrics interval: that pass reads the gateway
    # all the same and scales up, and the watch is called off.
    held["ns/m"] = 1.0
    harness.clock.now += 0.2
    harness.run(deployment_at(0), [])
    assert harness.deployments()[-1]["spec"]["replicas"] == 1 and watched[-1] is None
    # Awake, the interval holds again: no pass between scrapes reads the gateway.
    held.clear()
    harness.clock.now += 0.2
    harness.run(deployment_at(1), [])


def test_a_service_refused_its_served_name_says_so_until_it_owns_it() -> None:
    harness = Harness(service(model={"uri": "file:///models/tiny", "servedName": "m"}))
    owners = {"m": "older"}
    harness.controller.name_owner = owners.get
    harness.run()
    conflict = _condition(harness, "NameConflict")
    assert (conflict["status"], conflict["reason"]) == ("True", "ServedNameTaken")
    assert "'m' belongs to 'older'" in conflict["message"]
    harness.run()
    assert harness.reasons().count("ServedNameTaken") == 1, "announced once"
    owners["m"] = "svc"  # the older one was deleted
    harness.clock.now += 60
    harness.run()
    assert "NameConflict" not in {c["type"] for c in harness.cluster.statuses[-1]["conditions"]}


def test_a_new_service_that_may_scale_to_zero_starts_with_one_replica() -> None:
    harness = Harness(service(scaling={"minReplicas": 0}))
    harness.run()
    assert harness.deployments()[-1]["spec"]["replicas"] == 1


RUNTIME_UPDATES = {"allowRuntimeLoraUpdates": True}


def _adapter_states(harness: Harness) -> dict[str, tuple[str, int]]:
    return {a["name"]: (a["state"], a["readyReplicas"]) for a in harness.cluster.statuses[-1]["adapters"]}


def _condition(harness: Harness, kind: str) -> dict[str, Any]:
    return next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == kind)


def test_adapters_are_loaded_into_ready_replicas_and_removed_ones_unloaded_without_a_rollout() -> None:
    adapters = [{"name": "sql", "uri": "pvc://adapters/sql"}, {"name": "chat", "uri": "file:///lora/chat"}]
    harness = Harness(service(adapters=adapters, engine={"apiKeySecret": "keys", **RUNTIME_UPDATES}))
    harness.cluster.secrets = {("ns", "keys", "KVFLEET_API_KEY"): "s3cret"}
    harness.cluster.secret_labels_by_name = {("ns", "keys"): FOR_KVFLEET}
    harness.run()
    assert _adapter_states(harness) == {"sql": ("Pending", 0), "chat": ("Pending", 0)}
    harness.run(deployment_at(2), ready_pods(2))
    assert harness.replicas.served_by_pod == {
        pod: {"sql": "/mnt/adapter-claims/adapters/sql", "chat": "/lora/chat"} for pod in ("svc-0", "svc-1")
    }
    assert {call[3] for call in harness.replicas.calls} == {"s3cret"}, "the Secret's key authenticates"
    assert harness.cluster.secret_reads == 1, "read once a minute, not on every pass"
    assert _adapter_states(harness) == {"sql": ("Ready", 2), "chat": ("Ready", 2)}
    assert _condition(harness, "AdaptersReady")["status"] == "True"
    template = harness.deployments()[-1]["spec"]["template"]

    harness.body["spec"]["adapters"] = [adapters[0], {"name": "new", "uri": "pvc://adapters/new"}]
    harness.body["metadata"]["generation"] = 2
    harness.run(deployment_at(2), ready_pods(2))
    assert harness.deployments()[-1]["spec"]["template"] == template, "no new template: no pod restarts"
    assert set(harness.replicas.served_by_pod["svc-0"]) == {"sql", "new"}
    assert ("unload", "svc-1", "chat", "s3cret") in harness.replicas.calls
    assert _adapter_states(harness) == {"sql": ("Ready", 2), "new": ("Ready", 2)}
    harness.clock.now += 60
    harness.cluster.secrets[("ns", "keys", "KVFLEET_API_KEY")] = "rotated"
    harness.body["spec"]["adapters"] = [adapters[0]]
    harness.run(deployment_at(2), ready_pods(2))
    assert harness.replicas.calls[-1][3] == "rotated", "a rotated key is used within a minute"


def test_a_refused_adapter_fails_with_the_runtime_reason_and_is_retried_later() -> None:
    harness = Harness(service(adapters=[{"name": "big", "uri": "file:///lora/big"}], engine=RUNTIME_UPDATES))
    harness.replicas.refuse["/lora/big"] = "rank 64 is above --max-lora-rank 16"
    harness.run()
    harness.run(deployment_at(1), ready_pods(1))
    assert _adapter_states(harness) == {"big": ("Failed", 0)}
    condition = _condition(harness, "AdaptersReady")
    assert (condition["status"], condition["reason"]) == ("False", "AdapterLoadFailed")
    assert "big: rank 64 is above --max-lora-rank 16" in condition["message"]
    assert ("Warning", "AdapterLoadFailed", condition["message"]) in harness.events
    loads = len(harness.replicas.calls)
    harness.clock.now += 5
    harness.run(deployment_at(1), ready_pods(1))
    assert len(harness.replicas.calls) == loads, "not retried on every pass"
    del harness.replicas.refuse["/lora/big"]
    harness.clock.now += 60
    harness.run(deployment_at(1), ready_pods(1))
    assert _adapter_states(harness) == {"big": ("Ready", 1)}


def test_adapter_states_while_replicas_are_missing_or_silent() -> None:
    harness = Harness(service(adapters=[{"name": "a", "uri": "file:///lora/a"}], engine=RUNTIME_UPDATES))
    harness.replicas.silent.add("svc-1")
    harness.run()
    harness.run(deployment_at(2), ready_pods(2))
    assert _adapter_states(harness) == {"a": ("Loading", 1)}
    assert "svc-1: /v1/models did not answer" in harness.cluster.statuses[-1]["adapters"][0]["message"]
    assert _condition(harness, "AdaptersReady")["reason"] == "AdaptersLoading"


def test_an_unreadable_api_key_fails_every_adapter() -> None:
    harness = Harness(
        service(adapters=[{"name": "a", "uri": "file:///lora/a"}], engine={"apiKeySecret": "k"})
    )
    harness.cluster.secrets = None
    harness.cluster.secret_labels_by_name = {("ns", "k"): FOR_KVFLEET}
    harness.run(deployment_at(1), ready_pods(1))
    assert _adapter_states(harness) == {"a": ("Failed", 0)}
    assert "cannot read the API key from Secret k" in _condition(harness, "AdaptersReady")["message"]
    assert harness.replicas.calls == []


def test_without_runtime_updates_adapters_are_only_read_from_the_replicas() -> None:
    """Their flags serve them: the operator neither loads nor unloads, and a client key cannot either."""
    harness = Harness(service(adapters=[{"name": "a", "uri": "file:///lora/a"}]))
    harness.replicas.served_by_pod = {"svc-0": {"a": "/lora/a", "stray": "/elsewhere"}, "svc-1": {}}
    harness.run(deployment_at(2), ready_pods(2))
    assert [call[0] for call in harness.replicas.calls] == []
    assert _adapter_states(harness) == {"a": ("Loading", 1)}


def test_only_secrets_labelled_for_kvfleet_may_be_named() -> None:
    """A service's author need not be able to read a Secret to name it: its pods would get the Secret (as
    HF_TOKEN, the API key, registry credentials). Until the Secret is labelled nothing is rendered."""
    spec = {
        "model": {"uri": "hf://org/model", "credentialsSecret": "db-password"},
        "engine": {"apiKeySecret": "keys", "imagePullSecrets": ["registry"]},
    }
    harness = Harness(service(**spec))
    labels = harness.cluster.secret_labels_by_name
    labels.update({("ns", "db-password"): {"app": "billing"}, ("ns", "keys"): FOR_KVFLEET})
    harness.run()
    assert harness.cluster.applied == []
    ready = _condition(harness, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "SecretNotLabelled")
    assert ready["message"].startswith(
        "spec.model.credentialsSecret: Secret ns/db-password is not labelled kvfleet.dev/secret=true"
    )
    labels[("ns", "db-password")] = {**labels[("ns", "db-password")], SECRET_LABEL: "true"}
    harness.clock.now += 60  # labels are read again once a minute
    harness.run()
    ready = _condition(harness, "Ready")
    assert (ready["reason"], harness.cluster.applied) == ("SecretUnavailable", [])
    assert ready["message"] == (
        'spec.engine.imagePullSecrets[0]: cannot read Secret ns/registry: secrets "registry" not found'
    )
    labels[("ns", "registry")] = FOR_KVFLEET
    harness.run()
    assert [m["kind"] for m in harness.cluster.applied] == ["Deployment", "Service", "PodDisruptionBudget"]
    # A label taken away stops the next renders; what runs stays as it was.
    labels[("ns", "keys")] = {}
    harness.clock.now += 60
    applied = len(harness.cluster.applied)
    harness.body["metadata"]["generation"] = 2
    harness.run(deployment_at(1), ready_pods(1))
    assert len(harness.cluster.applied) == applied
    assert _condition(harness, "Ready")["message"].startswith(
        "spec.engine.apiKeySecret: Secret ns/keys is not"
    )


def test_a_child_whose_name_another_object_holds_is_reported_not_taken_over() -> None:
    harness = Harness(service())
    message = "Deployment ns/svc already exists and has no controller: it is not taken over"
    harness.cluster.fail_with = ChildNotOwned(message)
    harness.run()
    ready = _condition(harness, "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "ChildNotOwned", message)
    assert ("Warning", "ChildNotOwned", message) in harness.events
    harness.cluster.fail_with = None
    harness.clock.now += 300
    harness.run()
    assert _condition(harness, "Ready")["reason"] == "DeploymentPending", "applied once the name is free"


def test_services_without_lora_report_no_adapters() -> None:
    harness = Harness(service())
    harness.run(deployment_at(1), ready_pods(1))
    status = harness.cluster.statuses[-1]
    assert "adapters" not in status
    assert "AdaptersReady" not in {c["type"] for c in status["conditions"]}


# ---- spec.safety -------------------------------------------------------------------------------

SAFETY_PLATFORM = SafetyPlatform.parse('{"input": ["rules"], "rules": {}}', "")


def _controller(
    cluster: FakeCluster, events: list[tuple[str, str, str]], guard: list[GuardState]
) -> ServiceController:
    return ServiceController(
        owner=Owner("svc", "ns", "uid-1"),
        cluster=cluster,
        scraper=FakeScraper(),
        events=lambda *event: events.append(event),
        metrics=OperatorMetrics(),
        options=lambda: RenderOptions(safety=SAFETY_PLATFORM),
        adapter_sync=AdapterSync(FakeReplicas()),
        guard_state=lambda name: guard[0],
    )


def test_a_loosening_service_is_not_rendered_and_says_why() -> None:
    cluster, events = FakeCluster(), []
    controller = _controller(cluster, events, [GuardState.READY])
    asyncio.run(controller.reconcile(service(safety={"level": "off"}), Observed(None, [])))
    assert cluster.applied == []
    (ready,) = [c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "SafetyLoosened")
    assert ("Warning", "SafetyLoosened") in [(kind, reason) for kind, reason, _ in events]


def test_a_vllm_service_under_the_platforms_safety_policy_is_not_rendered_and_says_why() -> None:
    cluster, events = FakeCluster(), []
    controller = _controller(cluster, events, [GuardState.READY])
    asyncio.run(controller.reconcile(service(engine={"runtime": "vllm"}), Observed(None, [])))
    assert cluster.applied == []
    (ready,) = [c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "UnsupportedByRuntime")
    assert ("Warning", "UnsupportedByRuntime") in [(kind, reason) for kind, reason, _ in events]


def test_the_guards_state_is_in_the_status_with_an_event_while_it_is_unavailable() -> None:
    cluster, events, guard = FakeCluster(), [], [GuardState.NOT_FOUND]
    controller = _controller(cluster, events, guard)
    body = service(safety={"guard": {"service": "llama-guard"}})
    asyncio.run(controller.reconcile(body, Observed(None, [])))
    assert cluster.statuses[-1]["safety"] == {"guard": {"service": "llama-guard", "state": "NotFound"}}
    warnings = [message for kind, reason, message in events if reason == "GuardUnavailable"]
    assert warnings == [
        "the guard service 'llama-guard' is NotFound: checks that need it fail open or closed as "
        "spec.safety.guard.failOpen says"
    ]
    guard[0] = GuardState.READY
    asyncio.run(controller.reconcile(body, Observed(None, [])))
    assert cluster.statuses[-1]["safety"]["guard"]["state"] == "Ready"
    assert [reason for _, reason, _ in events].count("GuardAvailable") == 1


def grouped_service(**scaling: Any) -> dict[str, Any]:
    """Tensor parallel 2 on nodes of one GPU: each replica is a group of two pods."""
    body = service(engine={"tensorParallelSize": 2}, resources={"gpusPerNode": 1})
    body["spec"]["scaling"] = scaling
    return body


def group_set(group: int, ready: int = 2, updated: int = 2, revision: str = "r1") -> StatefulSetView:
    return StatefulSetView(f"svc-{group}", group, 1, 1, 2, ready, updated, revision, owner_uid=UID)


def group_pods(group: int, ready: int = 2, revision: str = "r1") -> list[PodView]:
    return [
        PodView(
            f"svc-{group}-{rank}",
            f"127.2.{group}.{rank + 1}",
            rank < ready,
            False,
            group=group,
            rank=rank,
            revision=revision,
        )
        for rank in range(2)
    ]


def test_groups_are_stateful_sets_with_ranks_in_status() -> None:
    harness = Harness(grouped_service(replicas=2))
    harness.run()
    kinds = [m["kind"] for m in harness.cluster.applied]
    assert kinds == ["StatefulSet", "StatefulSet", "Service", "Service", "PodDisruptionBudget"]
    assert [m["metadata"]["name"] for m in harness.cluster.applied[:3]] == ["svc-0", "svc-1", "svc-ranks"]
    harness.run(None, [*group_pods(0), *group_pods(1, ready=1)], (group_set(0), group_set(1, ready=1)))
    status = harness.cluster.statuses[-1]
    assert status["groups"] == [
        {"name": "svc-0", "ranks": 2, "ranksReady": 2},
        {"name": "svc-1", "ranks": 2, "ranksReady": 1},
    ]
    assert (status["replicas"], status["readyReplicas"]) == (2, 1), "replicas count groups"
    groups_ready = next(c for c in status["conditions"] if c["type"] == "GroupsReady")
    assert (groups_ready["status"], groups_ready["reason"]) == ("False", "RanksStarting")
    assert groups_ready["message"] == "svc-1: 1 of 2 ranks ready"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", "one whole group serves"
    harness.run(None, [*group_pods(0), *group_pods(1)], (group_set(0), group_set(1)))
    groups_ready = next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == "GroupsReady")
    assert (groups_ready["status"], groups_ready["reason"]) == ("True", "AllRanksReady")


def test_the_autoscaler_scrapes_rank_zero_and_adds_whole_groups() -> None:
    harness = Harness(grouped_service(minReplicas=1, maxReplicas=3, targetQueueDepth=4, panicWindowSeconds=1))
    harness.scraper.per_pod = PodMetrics(waiting=10, running=2)
    harness.run()
    harness.clock.now += 5
    harness.run(None, group_pods(0), (group_set(0),))
    assert harness.scraper.calls[-1] == ["http://127.2.0.1:8000/metrics"], "rank 1 serves no metrics"
    groups = [m["metadata"]["name"] for m in harness.cluster.applied if m["kind"] == "StatefulSet"]
    assert groups[-3:] == ["svc-0", "svc-1", "svc-2"]
    assert all(m["spec"]["replicas"] == 2 for m in harness.cluster.applied if m["kind"] == "StatefulSet")
    assert harness.controller.desired == 3


def test_scaling_down_deletes_the_highest_groups() -> None:
    harness = Harness(grouped_service(replicas=1))
    harness.run(None, [*group_pods(0), *group_pods(1)], (group_set(0), group_set(1)))
    assert harness.cluster.deleted == [("StatefulSet", "svc-1")]
    applied = [m["metadata"]["name"] for m in harness.cluster.applied if m["kind"] == "StatefulSet"]
    assert applied == ["svc-0"]


def test_changing_shape_deletes_the_old_workload() -> None:
    harness = Harness(grouped_service(replicas=1))
    harness.run(deployment_at(1), ready_pods(1))
    assert ("Deployment", "svc") in harness.cluster.deleted
    harness = Harness(service(scaling={"replicas": 1}))
    harness.run(deployment_at(1), ready_pods(1), (group_set(0),))
    assert harness.cluster.deleted == [("StatefulSet", "svc-0")]


def test_a_new_template_restarts_one_serving_group_at_a_time() -> None:
    harness = Harness(grouped_service(replicas=2))
    pods = [*group_pods(0), *group_pods(1)]
    outdated = (group_set(0, updated=0, revision="r2"), group_set(1, updated=0, revision="r2"))
    harness.run(None, pods, outdated)
    assert harness.cluster.deleted_pods == [{SERVICE_LABEL: "svc", GROUP_LABEL: "0"}]
    assert harness.reasons()[-1] == "GroupRestarted"
    # Group 0 is coming back on the new revision: group 1 keeps serving meanwhile.
    restarting = [*group_pods(0, ready=0), *group_pods(1)]
    harness.run(None, restarting, (group_set(0, ready=0, updated=2, revision="r2"), outdated[1]))
    assert len(harness.cluster.deleted_pods) == 1
    harness.run(None, pods, (group_set(0, revision="r2"), outdated[1]))
    assert harness.cluster.deleted_pods[-1] == {SERVICE_LABEL: "svc", GROUP_LABEL: "1"}
    harness.run(None, pods, (group_set(0, revision="r2"), outdated[1]))
    assert len(harness.cluster.deleted_pods) == 2, "a group is restarted once per revision"


def test_a_lost_rank_on_the_current_template_is_no_reason_to_restart_its_group() -> None:
    """A rank's pod deleted: the StatefulSet counts one pod fewer on its revision until the new one exists,
    yet no pod runs an older template (the runtime's other ranks restart themselves)."""
    harness = Harness(grouped_service(replicas=1))
    rank0, rank1 = group_pods(0)
    replacing = PodView(rank1.name, rank1.ip, False, True, group=0, rank=1, revision="r1")
    harness.run(None, [rank0, replacing], (group_set(0, ready=1, updated=1),))
    harness.run(None, [rank0], (group_set(0, ready=1, updated=1),))
    assert harness.cluster.deleted_pods == []
    assert "GroupRestarted" not in harness.reasons()
    # A pod of an older template left in the group still restarts it.
    harness.run(None, [rank0, *group_pods(0, revision="r0")[1:]], (group_set(0, ready=1, updated=1),))
    assert harness.cluster.deleted_pods == [{SERVICE_LABEL: "svc", GROUP_LABEL: "0"}]


def test_a_group_that_serves_nothing_restarts_at_once() -> None:
    harness = Harness(grouped_service(replicas=2))
    pods = [*group_pods(0), *group_pods(1, ready=1)]
    harness.run(
        None, pods, (group_set(0, updated=0, revision="r2"), group_set(1, 1, updated=0, revision="r2"))
    )
    assert harness.cluster.deleted_pods == [{SERVICE_LABEL: "svc", GROUP_LABEL: "1"}]


def test_groups_suspended_at_zero_are_scaled_to_zero_not_pending() -> None:
    harness = Harness(grouped_service(replicas=0))
    harness.run()
    harness.run()
    assert not [m for m in harness.cluster.applied if m["kind"] == "StatefulSet"]
    ready = next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero")
    assert harness.cluster.statuses[-1]["groups"] == []


# ---- spec.disaggregation ------------------------------------------------------------------------


def disaggregated(**roles: Any) -> dict[str, Any]:
    body = service(scaling={"panicWindowSeconds": 1})
    body["spec"]["disaggregation"] = roles
    return body


def role_deployment(role: Role, replicas: int, ready: int | None = None) -> DeploymentView:
    return dataclasses.replace(deployment_at(replicas, ready), role=role)


def role_pods(role: Role, count: int, first: int = 0) -> list[PodView]:
    return [
        PodView(f"svc-{role}-{i}", f"127.3.{0 if role == 'prefill' else 1}.{i + 1}", True, False, role=role)
        for i in range(first, first + count)
    ]


def role_replicas(harness: Harness) -> dict[str, int]:
    """The replicas last applied to each role's Deployment."""
    return {m["metadata"]["name"]: m["spec"]["replicas"] for m in harness.deployments()}


def test_a_disaggregated_service_gets_a_deployment_per_role_and_its_status() -> None:
    harness = Harness(disaggregated(decode={"scaling": {"minReplicas": 2}}))
    harness.run()
    applied = [(m["kind"], m["metadata"]["name"]) for m in harness.cluster.applied]
    assert applied == [
        ("Deployment", "svc-prefill"),
        ("Deployment", "svc-decode"),
        ("Service", "svc"),
        ("PodDisruptionBudget", "svc"),
    ]
    assert role_replicas(harness) == {"svc-prefill": 1, "svc-decode": 2}
    assert harness.reasons() == ["Created"]
    harness.run(
        None,
        [*role_pods("prefill", 1), *role_pods("decode", 2)],
        roles={"prefill": role_deployment("prefill", 1), "decode": role_deployment("decode", 2)},
    )
    status = harness.cluster.statuses[-1]
    assert {role: counts["readyReplicas"] for role, counts in status["roles"].items()} == {
        "prefill": 1,
        "decode": 2,
    }
    assert (status["desiredReplicas"], status["readyReplicas"]) == (3, 3)
    assert _condition(harness, "Ready")["status"] == "True"
    assert harness.metrics.desired_replicas.labels("ns", "svc")._value.get() == 3


def test_each_role_is_scaled_on_its_own_replicas_figures() -> None:
    harness = Harness(
        disaggregated(
            prefill={"scaling": {"maxReplicas": 4, "targetQueuedPromptTokens": 1000}},
            decode={"scaling": {"maxReplicas": 4, "targetQueueDepth": 8}},
        )
    )
    pods = [*role_pods("prefill", 1), *role_pods("decode", 2)]
    views: dict[Role, DeploymentView] = {
        "prefill": role_deployment("prefill", 1),
        "decode": role_deployment("decode", 2),
    }
    harness.run(None, pods, roles=views)
    # The prefill replica holds 3500 prompt tokens to compute; the decode replicas hold what they should.
    harness.scraper.by_pod = {
        pod.name: PodMetrics(waiting=3, running=1, queued_prompt_tokens=3500.0) for pod in pods[:1]
    }
    harness.scraper.per_pod = PodMetrics(waiting=0, running=8, kv_cache_usage=0.2, queued_prompt_tokens=0.0)
    harness.clock.now += 2
    harness.run(None, pods, roles=views)
    assert sorted(harness.scraper.calls[-1]) == sorted(f"http://{pod.ip}:8000/metrics" for pod in pods)
    assert role_replicas(harness) == {"svc-prefill": 4, "svc-decode": 2}
    scaled = [message for _, reason, message in harness.events if reason == "ScaledUp"]
    assert scaled == [
        "Scaled prefill from 1 to 4: panic: queued prompt tokens 3500.0 over the last 1s, "
        "target 1000 per replica"
    ]
    status = harness.cluster.statuses[-1]
    assert status["lastScaleReason"].startswith("prefill: panic: queued prompt tokens")
    assert status["roles"]["prefill"]["autoscaler"]["queuedPromptTokens"] == 3500.0
    assert status["roles"]["decode"]["autoscaler"]["queueDepth"] == 16.0


def test_while_no_prefill_replica_is_ready_the_decode_backlog_brings_it_back() -> None:
    harness = Harness(
        disaggregated(prefill={"scaling": {"minReplicas": 0, "targetQueuedPromptTokens": 1000}})
    )
    views: dict[Role, DeploymentView] = {
        "prefill": role_deployment("prefill", 0),
        "decode": role_deployment("decode", 1),
    }
    idle = PodMetrics(waiting=0, running=0, kv_cache_usage=0.0, queued_prompt_tokens=0.0)
    harness.scraper.per_pod = idle
    harness.run(None, role_pods("decode", 1), roles=views)
    assert role_replicas(harness)["svc-prefill"] == 0, "at zero and idle: stays at zero"
    ready = _condition(harness, "Ready")
    assert ready["status"] == "True", "the decode replicas serve alone"
    # Long prompts reach the decode replica, which computes them itself meanwhile.
    harness.scraper.per_pod = PodMetrics(
        waiting=2, running=1, kv_cache_usage=0.1, queued_prompt_tokens=1800.0
    )
    harness.clock.now += 2
    harness.run(None, role_pods("decode", 1), roles=views)
    assert role_replicas(harness) == {"svc-prefill": 2, "svc-decode": 1}


def test_turning_disaggregated_and_back_deletes_the_other_shapes_workload() -> None:
    harness = Harness(disaggregated())
    harness.run(deployment_at(2), ready_pods(2))
    assert harness.cluster.deleted == [("Deployment", "svc")]
    harness.body["spec"].pop("disaggregation")
    harness.body["metadata"]["generation"] = 2
    roles = {"prefill": role_deployment("prefill", 1), "decode": role_deployment("decode", 1)}
    harness.run(None, [*role_pods("prefill", 1), *role_pods("decode", 1)], roles=roles)
    assert harness.cluster.deleted[1:] == [("Deployment", "svc-prefill"), ("Deployment", "svc-decode")]
    assert [m["metadata"]["name"] for m in harness.deployments()][-1] == "svc"
    assert harness.cluster.statuses[-1]["roles"] is None, "the roles are cleared from the status"


def test_fixed_role_replicas_are_kept_and_never_scraped() -> None:
    harness = Harness(
        disaggregated(prefill={"scaling": {"replicas": 2}}, decode={"scaling": {"replicas": 3}})
    )
    assert harness.run() == IDLE_PASS_SECONDS
    roles = {"prefill": role_deployment("prefill", 5), "decode": role_deployment("decode", 3)}
    harness.run(None, [*role_pods("prefill", 2), *role_pods("decode", 3)], roles=roles)
    assert harness.scraper.calls == []
    assert role_replicas(harness) == {"svc-prefill": 2, "svc-decode": 3}, "a drifted count is put back"


def test_a_restarted_operator_keeps_each_roles_count() -> None:
    harness = Harness(disaggregated(decode={"scaling": {"maxReplicas": 8}}))
    roles = {"prefill": role_deployment("prefill", 2), "decode": role_deployment("decode", 5)}
    harness.run(None, [], roles=roles)
    assert role_replicas(harness) == {"svc-prefill": 2, "svc-decode": 5}
    assert "Created" not in harness.reasons()


def test_a_role_that_stops_autoscaling_has_its_figures_cleared() -> None:
    harness = Harness(disaggregated())
    harness.scraper.per_pod = PodMetrics(waiting=0, running=1, kv_cache_usage=0.1, queued_prompt_tokens=10.0)
    pods = [*role_pods("prefill", 1), *role_pods("decode", 1)]
    roles = {"prefill": role_deployment("prefill", 1), "decode": role_deployment("decode", 1)}
    harness.run(None, pods, roles=roles)
    assert "autoscaler" in harness.cluster.statuses[-1]["roles"]["prefill"]
    harness.body["spec"]["disaggregation"] = {"prefill": {"scaling": {"replicas": 1}}}
    harness.body["metadata"]["generation"] = 2
    harness.clock.now += 2
    harness.run(None, pods, roles=roles)
    patch = harness.cluster.statuses[-1]["roles"]
    assert patch["prefill"]["autoscaler"] is None, "a merge patch must name what it removes"
    assert patch["decode"]["autoscaler"]["queueDepth"] == 1.0


def test_the_watch_indexes_give_each_role_its_deployment_and_leave_namesakes_out() -> None:
    colocated = deployment_at(1)
    prefill, decode = role_deployment("prefill", 1, ready=1), role_deployment("decode", 2, ready=0)
    stray = dataclasses.replace(role_deployment("decode", 9), owner_uid="someone-else")
    indexes: dict[str, Any] = {
        "pods": {},
        "deployments": {
            ("ns", "svc"): [colocated, prefill, decode, stray],
            ("ns", "guard"): [prefill, decode],
        },
        "stateful_sets": {},
        "leader_worker_sets": {},
        "gateways": {},
        "served_names": {},
    }
    cluster = handlers._IndexedCluster(namespace="ns", name="svc", uid=UID, gateway_queues=None, **indexes)  # type: ignore[arg-type]
    observed = cluster.observe()
    assert observed.deployment == colocated
    assert observed.roles == {"prefill": prefill, "decode": decode}
    # A disaggregated guard serves only through its decode role, none of which is ready here.
    assert cluster.guard_state("guard") is GuardState.UNAVAILABLE
