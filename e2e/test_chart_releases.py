"""Two releases of the chart side by side, as two teams (or a staging copy) install them: each with its own
PriorityClasses and its own namespaces, each operator reconciling only those; and `kubectl scale` on an
InferenceService, through its scale subresource, as one of them runs it.

The session's release watches every namespace; for this module it watches one (team A's), and a second
release watches team B's. Their pods are kwok's (no process): what is checked is which operator rendered
them, told by the tier's PriorityClass each release names after itself."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.cluster import ApiError, LocalCluster
from e2e.conftest import fresh_namespace
from e2e.fleet.chart import OperatorRelease, install_chart, uninstall_chart
from e2e.fleet.gateway import upgrade_release
from e2e.fleet.manifests import deployment_path, fake_gpu_service, services_path
from e2e.support.waits import wait_for

TIERS = ("critical", "high", "standard", "batch")
SECOND_RELEASE = "team-b"


@dataclass(frozen=True)
class TwoReleases:
    first: OperatorRelease
    second: OperatorRelease
    team_a: str
    team_b: str
    unwatched: str


def _delete_services(local_cluster: LocalCluster, namespace: str) -> None:
    """Deletes the namespace's InferenceServices; waits until their operator let them go (its finalizer)."""
    local_cluster.api.delete(services_path(namespace))
    wait_for(
        f"the InferenceServices of {namespace} to be gone",
        lambda: not local_cluster.api.get(services_path(namespace))["items"],
        timeout=60,
    )


@pytest.fixture(scope="module")
def two_releases(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    module_namespace: str,
    measurements: Callable[[str], None],
) -> Iterator[TwoReleases]:
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        team_b = stack.enter_context(fresh_namespace(local_cluster, f"{module_namespace[:50]}-b"))
        unwatched = stack.enter_context(fresh_namespace(local_cluster, f"{module_namespace[:50]}-c"))
        system = stack.enter_context(fresh_namespace(local_cluster, f"{module_namespace[:48]}-sys"))
        upgrade_release(local_cluster, kvfleet_release, f"watchNamespaces={{{module_namespace}}}")
        # An empty list: every namespace again. `--set` cannot say it (`{}` is a list of one empty name), and
        # its null is lost to --reuse-values, which would keep this module's namespace after it is deleted.
        stack.callback(upgrade_release, local_cluster, kvfleet_release, json_values={"watchNamespaces": []})
        second = install_chart(
            local_cluster, {"watchNamespaces": f"{{{team_b}}}"}, namespace=system, release=SECOND_RELEASE
        )
        stack.callback(uninstall_chart, second)
        # Before its operator goes: it holds their finalizers.
        stack.callback(_delete_services, local_cluster, team_b)
        measurements(f"two releases, each watching its namespace, in {time.monotonic() - started:.1f}s")
        yield TwoReleases(kvfleet_release, second, module_namespace, team_b, unwatched)


def _deployment(local_cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The service's Deployment; None until its operator has created it."""
    try:
        return local_cluster.api.get(deployment_path(namespace, name))
    except ApiError as error:
        if error.status == 404:
            return None
        raise


def _pod_priority_class(local_cluster: LocalCluster, namespace: str, name: str) -> str | None:
    deployment = _deployment(local_cluster, namespace, name)
    return None if deployment is None else deployment["spec"]["template"]["spec"].get("priorityClassName")


def test_each_release_has_its_priority_classes_and_reconciles_only_its_namespaces(
    local_cluster: LocalCluster, two_releases: TwoReleases, measurements: Callable[[str], None]
) -> None:
    api = local_cluster.api
    names = {
        item["metadata"]["name"] for item in api.get("/apis/scheduling.k8s.io/v1/priorityclasses")["items"]
    }
    for release in (two_releases.first, two_releases.second):
        assert {f"{release.release}-{tier}" for tier in TIERS} <= names
        assert len(release.operator_pods()) == 1
    created = time.monotonic()
    for namespace in (two_releases.team_a, two_releases.team_b, two_releases.unwatched):
        api.create(services_path(namespace), fake_gpu_service("llm", scaling={"replicas": 0}))
    # Each team's service is rendered by its own release's operator, which names the tier's class after it.
    for namespace, release in (
        (two_releases.team_a, two_releases.first),
        (two_releases.team_b, two_releases.second),
    ):
        expected = f"{release.release}-standard"
        seen = wait_for(
            f"the Deployment of {namespace}/llm from {release.release}'s operator",
            lambda namespace=namespace: _pod_priority_class(local_cluster, namespace, "llm"),
            timeout=60,
        )
        assert seen == expected
        measurements(
            f"{release.release}'s operator rendered its service {time.monotonic() - created:.1f}s after"
        )
    assert (
        _pod_priority_class(local_cluster, two_releases.team_a, "llm")
        == f"{two_releases.first.release}-standard"
    )
    unwatched = api.get(services_path(two_releases.unwatched, "llm"))
    assert "status" not in unwatched and not unwatched["metadata"].get("finalizers"), "no operator watches it"
    assert _pod_priority_class(local_cluster, two_releases.unwatched, "llm") is None


def _scale(local_cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    return local_cluster.api.get(f"{services_path(namespace, name)}/scale")


def test_kubectl_scale_sets_the_replicas_the_operator_runs(
    local_cluster: LocalCluster, two_releases: TwoReleases
) -> None:
    api, namespace = local_cluster.api, two_releases.team_a
    api.create(services_path(namespace), fake_gpu_service("fixed", scaling={"replicas": 1}))
    local_cluster.kubectl("scale", "kvis", "fixed", "-n", namespace, "--replicas=3")

    def scaled() -> dict[str, Any] | None:
        deployment = _deployment(local_cluster, namespace, "fixed")
        return deployment if deployment is not None and deployment["spec"]["replicas"] == 3 else None

    wait_for("the operator to run the 3 replicas kubectl scale asked for", scaled, timeout=60)
    assert api.get(services_path(namespace, "fixed"))["spec"]["scaling"]["replicas"] == 3
    scale = wait_for(
        "the scale subresource to report 3 replicas and the selector",
        lambda: (s := _scale(local_cluster, namespace, "fixed"))["status"].get("selector") and s,
        timeout=60,
    )
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"] == "kvfleet.dev/inference-service=fixed"

    # A service the autoscaler sizes refuses the write, which would switch its autoscaler off.
    api.create(services_path(namespace), fake_gpu_service("autoscaled", scaling={"replicas": None}))
    refused = local_cluster.kubectl(
        "scale", "kvis", "autoscaled", "-n", namespace, "--replicas=3", check=False
    )
    assert refused.returncode != 0
    assert "scaling.replicas may not be set on a service the autoscaler sizes" in refused.stderr
    assert "replicas" not in api.get(services_path(namespace, "autoscaled"))["spec"]["scaling"]
