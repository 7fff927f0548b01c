"""The product on containers: a local control plane whose pod runner runs kvfleet's pods from the built images
(podman, the pods' own securityContext), `helm install` of the chart, the tiny example applied, chatted with
through the openai SDK, and deleted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfleet.operator.render_pod import RUNTIME_USER

from e2e.cluster import ClusterConfig, LocalCluster, ensure_binaries
from e2e.fleet.chart import install_chart, uninstall_chart
from e2e.fleet.manifests import services_path, tiny_example
from e2e.fleet.observe import service_pods, wait_ready
from e2e.fleet.traffic import ReadyEndpoints, chat
from e2e.support.waits import wait_for
from images.build import image_name, pod_images
from images.tests.conftest import podman_output

NAMESPACE = "fleet-on-images"
# The operator and the runtime load in containers on 2 busy cores.
READY_SECONDS = 300.0


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, runtime_image: str, operator_image: str
) -> Iterator[LocalCluster]:
    config = ClusterConfig(nodes=1, container_images=pod_images())
    with LocalCluster(tmp_path_factory.mktemp("cluster"), config, bin_dir=ensure_binaries()) as running:
        yield running


def pod_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """`podman container inspect` of the containers the runner started for a pod (by their pod labels)."""
    uid = pod["metadata"]["uid"]
    names = podman_output("ps", "--filter", f"label=io.kubernetes.pod.uid={uid}", "--format", "{{.Names}}")
    return json.loads(podman_output("container", "inspect", *names.split())) if names.strip() else []


def assert_runs_as_the_pod_asks(pod: dict[str, Any], image: str) -> None:
    (container,) = pod_containers(pod)
    assert container["ImageName"] == image
    assert container["Config"]["User"] == f"{RUNTIME_USER}:{RUNTIME_USER}"
    assert container["HostConfig"]["ReadonlyRootfs"] is True
    assert container["HostConfig"]["CapDrop"], "capabilities: drop ALL"
    assert container["State"]["Running"] is True


def test_the_chart_and_the_tiny_example_run_on_the_images(
    cluster: LocalCluster, tiny_model_dir: Path
) -> None:
    release = install_chart(cluster)  # --wait: the operator's container answered its readiness probe
    assert_runs_as_the_pod_asks(release.operator_pod(), image_name("operator"))

    manifest = tiny_example(tiny_model_dir)
    name = manifest["metadata"]["name"]
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(manifest))
    wait_ready(cluster.api, NAMESPACE, name, timeout=READY_SECONDS)
    (pod,) = service_pods(cluster.api, NAMESPACE, name)
    assert_runs_as_the_pod_asks(pod, image_name("runtime"))
    (runtime,) = pod_containers(pod)
    model_mount = next(m for m in runtime["Mounts"] if m["Destination"] == str(tiny_model_dir))
    assert model_mount["RW"] is False

    with ReadyEndpoints(cluster.api, NAMESPACE, name) as endpoints:
        endpoint = endpoints.current()[0]
    answer = chat(endpoint, "Say hello.", max_tokens=8, model=manifest["spec"]["model"]["servedName"])
    assert isinstance(answer, str)

    # Deleting the service drains its pod; the runner removes the container.
    cluster.api.delete(services_path(NAMESPACE, name))
    wait_for("the runtime pod's container to go", lambda: not pod_containers(pod), timeout=120)
    uninstall_chart(release)
    leftover = podman_output(
        "ps", "--all", "--filter", "label=io.kubernetes.pod.namespace", "--format", "{{.Names}}"
    )
    assert leftover.strip() == "", "every container the runner started is gone"
