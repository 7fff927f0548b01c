"""Node objects for kwok to manage: fake machines that advertise GPUs to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_SELECTOR = f"{KWOK_NODE_ANNOTATION}=fake"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeShape:
    """What each fake node offers the scheduler."""

    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    max_pods: int = 110
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"gpus per node must be >= 0, got {self.gpus}")
        if self.max_pods < 1:
            raise ValueError(f"max_pods must be >= 1, got {self.max_pods}")


def fake_node(name: str, shape: NodeShape) -> dict[str, Any]:
    """A Node manifest kwok takes over (by its annotation), with its capacity in status as a kubelet sets it.

    No podCIDR: kwok then hands out pod IPs from its own --cidr range, and recent API servers reject the
    non-canonical CIDRs a loopback range would need here.
    """
    resources = {"cpu": shape.cpu, "memory": shape.memory, "pods": str(shape.max_pods)}
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    if shape.gpus:
        resources[GPU_RESOURCE] = str(shape.gpus)
        labels["nvidia.com/gpu.present"] = "true"
        labels["nvidia.com/gpu.product"] = shape.gpu_product
        labels["nvidia.com/gpu.count"] = str(shape.gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_NODE_ANNOTATION: "fake"}},
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def fake_node_names(count: int, prefix: str = "kwok-gpu") -> list[str]:
    if count < 1:
        raise ValueError(f"a cluster needs at least one node, got {count}")
    return [f"{prefix}-{index}" for index in range(count)]
