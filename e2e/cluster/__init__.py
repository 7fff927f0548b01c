"""A real Kubernetes control plane on this machine, for end-to-end tests and the demo."""

from __future__ import annotations

from .attached import AttachedCluster
from .binaries import ensure_binaries
from .cluster import ClusterConfig, LocalCluster
from .fake_nodes import GPU_RESOURCE, NodeShape
from .kube_api import ApiError, KubeAPI
from .pod_runner import PodRunner

__all__ = [
    "GPU_RESOURCE",
    "ApiError",
    "AttachedCluster",
    "ClusterConfig",
    "KubeAPI",
    "LocalCluster",
    "NodeShape",
    "PodRunner",
    "ensure_binaries",
]
