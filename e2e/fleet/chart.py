"""The kvfleet Helm chart on a local cluster: install, find the operator pod and its process, uninstall."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import ApiError, KubeAPI, PodRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "kvfleet"
CRD_DIR = REPO_ROOT / "crds"
EXAMPLES_DIR = REPO_ROOT / "examples"
OPERATOR_NAMESPACE = "kvfleet-system"
RELEASE = "kvfleet"
OPERATOR_CONTAINER = "operator"
OPERATOR_METRICS_PORT = 8080  # the chart's metrics.port
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvfleet,app.kubernetes.io/component=operator"
# The local cluster's tests make a namespace each and their models in temporary folders, claim every tier
# and run fake images; e2e/test_admission_policy.py applies a policy of its own for those checks. The
# installed policy keeps the chart's others (tolerations, env, flags).
LOCAL_CLUSTER_POLICY = {
    "admissionPolicy.hostPath.namespaces": "null",
    "admissionPolicy.hostPath.pathPrefixes": "null",
    "admissionPolicy.tierNamespaces": "null",
    "admissionPolicy.imagePrefixes": "null",
}


def node_kernel_cache() -> str:
    """The chart's runtime.kernelCache.hostPath on a local cluster: its pods run on this machine, and share
    its torch extension cache as a node's pods share that folder, so that only the first pod to need a CPU
    kernel build compiles it, and later clusters' pods compile nothing."""
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()


def local_cluster_values() -> dict[str, str]:
    """The values every release on a local cluster is installed with: LOCAL_CLUSTER_POLICY and the node's
    kernel cache (an upgrade that leaves one out drops it, and that release's pods compile their kernels)."""
    return LOCAL_CLUSTER_POLICY | {"runtime.kernelCache.hostPath": node_kernel_cache()}


class ClusterAccess(Protocol):
    """What the chart needs of a cluster: a LocalCluster, or an AttachedCluster another process runs."""

    pod_runner: PodRunner | None

    @property
    def api(self) -> KubeAPI: ...

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]: ...


@dataclass(frozen=True)
class OperatorRelease:
    """An installed release of the chart; its operator runs as a pod the pod runner runs."""

    cluster: ClusterAccess
    namespace: str = OPERATOR_NAMESPACE
    release: str = RELEASE

    def operator_pods(self) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        selector = f"{OPERATOR_SELECTOR},app.kubernetes.io/instance={self.release}"
        pods = self.cluster.api.get(path, labelSelector=selector)
        return [pod for pod in pods["items"] if not pod["metadata"].get("deletionTimestamp")]

    def operator_pod(self) -> dict[str, Any]:
        pods = self.operator_pods()
        if len(pods) != 1:
            raise AssertionError(f"expected one operator pod, found {[p['metadata']['name'] for p in pods]}")
        return pods[0]

    def operator_pid(self) -> int | None:
        """The PID of the operator's process, if it runs now."""
        runner = self.cluster.pod_runner
        if runner is None:
            raise RuntimeError("the operator only runs as a process with the pod runner")
        name = self.operator_pod()["metadata"]["name"]
        return runner.process_id(self.namespace, name, OPERATOR_CONTAINER)

    def operator_metrics(
        self, port: int = OPERATOR_METRICS_PORT
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The operator's own Prometheus metrics, read from its pod: (name, sorted labels) -> value."""
        ip = self.operator_pod()["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def operator_log(self) -> Path:
        runner = self.cluster.pod_runner
        if runner is None:
            raise RuntimeError("the operator only runs as a process with the pod runner")
        name = self.operator_pod()["metadata"]["name"]
        return runner.log_path(self.namespace, name, OPERATOR_CONTAINER)


def install_chart(
    cluster: ClusterAccess,
    values: dict[str, str] | None = None,
    namespace: str = OPERATOR_NAMESPACE,
    release: str = RELEASE,
    timeout_seconds: int = 180,
) -> OperatorRelease:
    """`helm install` of charts/kvfleet, waiting until the operator's Deployment is available; `values`
    go over local_cluster_values()."""
    settings = [f"--set={key}={value}" for key, value in (local_cluster_values() | (values or {})).items()]
    cluster.helm(
        "install",
        release,
        str(CHART_DIR),
        "--namespace",
        namespace,
        "--create-namespace",
        "--wait",
        f"--timeout={timeout_seconds}s",
        *settings,
    )
    return OperatorRelease(cluster, namespace, release)


def uninstall_chart(release: OperatorRelease, timeout_seconds: float = 60.0) -> None:
    """`helm uninstall`, then waits until the operator's pods (and so its process) are gone."""
    release.cluster.helm("uninstall", release.release, "--namespace", release.namespace, "--wait")
    path = f"/api/v1/namespaces/{release.namespace}/pods"
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            left = release.cluster.api.get(path, labelSelector=OPERATOR_SELECTOR)["items"]
        except ApiError:
            return
        if not left:
            return
        if time.monotonic() > deadline:
            names = [pod["metadata"]["name"] for pod in left]
            raise TimeoutError(f"operator pods {names} remain {timeout_seconds:.0f}s after helm uninstall")
        time.sleep(0.2)
