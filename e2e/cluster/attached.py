"""A handle on a cluster that another process runs (`python -m e2e.cluster up --detach`): the API, kubectl
and helm from its folder. Its pod runner lives in that process, so the cluster outlives whoever attached."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from .cluster import ClusterTools
from .kube_api import KubeAPI
from .pod_runner import PodRunner

READY_MARKER = "ready.json"


class AttachedCluster(ClusterTools):
    def __init__(self, directory: Path) -> None:
        self.state_dir = Path(directory).resolve()
        marker = self.state_dir / READY_MARKER
        if not marker.exists():
            raise RuntimeError(f"no running cluster in {self.state_dir} ({READY_MARKER} is missing)")
        info = json.loads(marker.read_text())
        self.kubeconfig = Path(info["kubeconfig"])
        self.server: str = info["server"]
        self.bin_dir = Path(info["binaries"])
        self.log_dir = Path(info["logs"])
        self.pod_runner: PodRunner | None = None
        config = yaml.safe_load(self.kubeconfig.read_text())
        token = config["users"][0]["user"]["token"]
        self.api = KubeAPI(self.server, token, str(self.state_dir / "pki" / "ca.crt"))

    def pod_log(self, namespace: str, pod: str, container: str) -> Path:
        """Where the runner writes a container's output (kubectl logs needs a kubelet)."""
        return self.state_dir / "pods" / namespace / pod / f"{container}.log"
