"""The per-service control loop against a recording fake cluster, scraper and clock."""

from __future__ import annotations

import asyncio
import copy
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from kvfleet.operator import controller as controller_module
from kvfleet.operator.autoscaler import PodMetrics
from kvfleet.operator.controller import IDLE_PASS_SECONDS, ServiceController
from kvfleet.operator.kube import KubeError
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.operator.observed import DeploymentView, PodView
from kvfleet.operator.render import Owner, RenderOptions, render_children
from kvfleet.operator.safety import GuardState, SafetyPlatform
from kvfleet.operator.scrape import ScrapeFailure, ScrapeTarget

UID = "uid-1"


@dataclass
class FakeCluster:
    applied: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    fail_with: KubeError | None = None

    async def apply(self, manifest: Mapping[str, Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.applied.append(copy.deepcopy(dict(manifest)))

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.statuses.append(copy.deepcopy(dict(status)))


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
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    body: dict[str, Any]
    cluster: FakeCluster = field(default_factory=FakeCluster)
    scraper: FakeScraper = field(default_factory=FakeScraper)
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
            clock=self.clock,
            wall_clock=lambda: (
                datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
                + datetime.timedelta(seconds=self.clock.now)
            ),
        )

    def run(self, deployment: DeploymentView | None = None, pods: list[PodView] | None = None) -> float:
        delay = asyncio.run(self.controller.reconcile(self.body, deployment, pods or []))
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

    def broken_observe() -> tuple[DeploymentView | None, list[PodView]]:
        calls["count"] += 1
        wakeup.set()  # skip the back-off wait; the loop must still come round
        if calls["count"] >= 2:
            stop.set()
        return None, [PodView("weird", "not-an-ip", True, False)]

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
    held = {"m": 0.0}
    asked: list[str] = []

    async def gateway_queue(model: str) -> float | None:
        asked.append(model)
        return held[model]

    harness.controller.gateway_queue = gateway_queue
    harness.run(deployment_at(0), [])
    assert harness.deployments()[-1]["spec"]["replicas"] == 0 and asked == ["m"]
    ready = next(c for c in harness.cluster.statuses[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    held["m"] = 2.0
    harness.clock.now += 2
    harness.run(deployment_at(0), [])
    assert harness.deployments()[-1]["spec"]["replicas"] == 1
    assert any(reason == "ScaledUp" for reason in harness.reasons())
    assert harness.scraper.calls == [], "nothing to scrape at zero"


def test_a_new_service_that_may_scale_to_zero_starts_with_one_replica() -> None:
    harness = Harness(service(scaling={"minReplicas": 0}))
    harness.run()
    assert harness.deployments()[-1]["spec"]["replicas"] == 1


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
        guard_state=lambda name: guard[0],
    )


def test_a_loosening_service_is_not_rendered_and_says_why() -> None:
    cluster, events = FakeCluster(), []
    controller = _controller(cluster, events, [GuardState.READY])
    asyncio.run(controller.reconcile(service(safety={"level": "off"}), None, []))
    assert cluster.applied == []
    (ready,) = [c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "SafetyLoosened")
    assert ("Warning", "SafetyLoosened") in [(kind, reason) for kind, reason, _ in events]


def test_the_guards_state_is_in_the_status_with_an_event_while_it_is_unavailable() -> None:
    cluster, events, guard = FakeCluster(), [], [GuardState.NOT_FOUND]
    controller = _controller(cluster, events, guard)
    body = service(safety={"guard": {"service": "llama-guard"}})
    asyncio.run(controller.reconcile(body, None, []))
    assert cluster.statuses[-1]["safety"] == {"guard": {"service": "llama-guard", "state": "NotFound"}}
    warnings = [message for kind, reason, message in events if reason == "GuardUnavailable"]
    assert warnings == [
        "the guard service 'llama-guard' is NotFound: checks that need it fail open or closed as "
        "spec.safety.guard.failOpen says"
    ]
    guard[0] = GuardState.READY
    asyncio.run(controller.reconcile(body, None, []))
    assert cluster.statuses[-1]["safety"]["guard"]["state"] == "Ready"
    assert [reason for _, reason, _ in events].count("GuardAvailable") == 1
