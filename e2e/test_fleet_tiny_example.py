"""The product as a user meets it: `helm install` of the chart, `kubectl apply` of the tiny example, a Ready
fleet with its printer columns and URL, chat answers through the openai SDK, and metrics the operator scrapes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import tiny_example
from e2e.fleet.observe import service_pods, wait_condition, wait_ready
from e2e.fleet.traffic import ChatLoad, ReadyEndpoints, chat
from e2e.support.waits import condition, wait_for

READY_BOUND_SECONDS = 120.0
TIERS = ("critical", "high", "standard", "batch")


@dataclass(frozen=True)
class AppliedExample:
    namespace: str
    name: str
    seconds_to_ready: float
    ready_object: dict[str, Any]


@pytest.fixture(scope="module")
def tiny(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    module_namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> AppliedExample:
    manifest = tiny_example(tiny_model_dir)
    started = time.monotonic()
    local_cluster.kubectl("apply", "-n", module_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    name = manifest["metadata"]["name"]
    ready = wait_ready(local_cluster.api, module_namespace, name, timeout=READY_BOUND_SECONDS)
    seconds = time.monotonic() - started
    measurements(f"tiny example Ready {seconds:.1f}s after kubectl apply")
    return AppliedExample(module_namespace, name, seconds, ready)


def test_helm_install_runs_the_operator(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease
) -> None:
    api = local_cluster.api
    releases = json.loads(
        local_cluster.helm("list", "--namespace", kvfleet_release.namespace, "--output", "json").stdout
    )
    assert [(r["name"], r["status"]) for r in releases] == [(kvfleet_release.release, "deployed")]

    crd = api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.kvfleet.dev")
    established = condition(crd, "Established")
    assert established is not None and established["status"] == "True"
    assert crd["spec"]["names"]["shortNames"] == ["kvis"]
    for tier in TIERS:
        api.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/kvfleet-{tier}")

    pod = kvfleet_release.operator_pod()
    ready = condition(pod, "Ready")
    assert ready is not None and ready["status"] == "True"
    assert pod["spec"]["serviceAccountName"] == kvfleet_release.release
    # A real process, answering on the pod's IP, runs with the ServiceAccount's token (the chart's RBAC).
    assert kvfleet_release.operator_pid() is not None
    assert ("kvfleet_operator_reconcile_duration_seconds_count", ()) in kvfleet_release.operator_metrics()


def test_tiny_example_is_ready_with_its_url(local_cluster: LocalCluster, tiny: AppliedExample) -> None:
    assert tiny.seconds_to_ready < READY_BOUND_SECONDS
    status = tiny.ready_object["status"]
    assert status["url"] == f"http://{tiny.name}.{tiny.namespace}.svc.cluster.local"
    assert status["readyReplicas"] == status["desiredReplicas"] == 1
    scheduled = condition(tiny.ready_object, "Scheduled")
    assert scheduled is not None and scheduled["status"] == "True"
    pods = service_pods(local_cluster.api, tiny.namespace, tiny.name)
    assert len(pods) == 1
    assert pods[0]["spec"]["priorityClassName"] == "kvfleet-standard"


def test_kubectl_get_shows_the_printer_columns(local_cluster: LocalCluster, tiny: AppliedExample) -> None:
    for resource in ("inferenceservices", "kvis"):
        output = local_cluster.kubectl("get", resource, tiny.name, "-n", tiny.namespace).stdout
        header, row = output.strip().splitlines()
        assert header.split() == [
            "NAME",
            "MODEL",
            "TIER",
            "DESIRED",
            "AVAILABLE",
            "URL",
            "READY",
            "REASON",
            "AGE",
        ]
        values = row.split()
        assert values[:8] == [
            tiny.name,
            tiny.ready_object["spec"]["model"]["uri"],
            "standard",
            "1",
            "1",
            f"http://{tiny.name}.{tiny.namespace}.svc.cluster.local",
            "True",
            "Available",
        ]


def test_chat_completion_through_the_openai_sdk(local_cluster: LocalCluster, tiny: AppliedExample) -> None:
    with ReadyEndpoints(local_cluster.api, tiny.namespace, tiny.name) as endpoints:
        (endpoint,) = endpoints.current()
    answer = chat(endpoint, "Say hello to the fleet.", max_tokens=16)
    assert answer.strip(), "the model answered with empty text"


def test_operator_scrapes_the_pods_metrics(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, tiny: AppliedExample
) -> None:
    api = local_cluster.api
    service = wait_condition(api, tiny.namespace, tiny.name, "ScalingActive", "True", "MetricsAvailable")
    assert service["status"]["autoscaler"]["reportingPods"] == 1
    series = ("kvfleet_operator_queue_depth", (("name", tiny.name), ("namespace", tiny.namespace)))

    def queue_depth() -> float | None:
        return kvfleet_release.operator_metrics().get(series)

    # The example's target is 4 per replica: 3 clients keep requests running without scaling it.
    with ReadyEndpoints(api, tiny.namespace, tiny.name) as endpoints, ChatLoad(endpoints, 3, 256) as load:
        busy = wait_for("the operator to scrape requests in flight", lambda: (queue_depth() or 0) > 0, 30)
    assert busy
    assert not load.failures(), load.failures()[:3]
    assert load.successes()
    wait_for("the scraped queue depth back to 0", lambda: queue_depth() == 0, 30)
