"""InferenceService manifests and API paths for the end-to-end tests, the demo and the fleet benchmark."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from e2e.fleet.chart import EXAMPLES_DIR

API_VERSION = "kvfleet.dev/v1alpha1"
KIND = "InferenceService"
SERVICE_LABEL = "kvfleet.dev/inference-service"
RUNTIME_PORT = 8000
# An image the pod runner does not run: kwok plays its pods' lifecycle (Running and Ready, no process).
# For what needs GPUs and schedulers but no server: fleets of hundreds, capacity, garbage collection.
FAKE_RUNTIME_IMAGE = "registry.invalid/gpu-runtime:1"
TINY_EXAMPLE = EXAMPLES_DIR / "tiny-cpu.yaml"


def services_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/{API_VERSION}/namespaces/{namespace}/inferenceservices"
    return f"{path}/{name}" if name else path


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"


def statefulset_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}"


def service_selector(name: str) -> str:
    return f"{SERVICE_LABEL}={name}"


def _merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """base with override merged in, key by key; None removes a key."""
    result = copy.deepcopy(dict(base))
    for key, value in override.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def inference_service(name: str, spec: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": copy.deepcopy(dict(spec))}


def one_node_per_pod(name: str) -> dict[str, Any]:
    """An affinity that puts each pod of the service on a node of its own, as nodes of one GPU would."""
    selector = {"matchLabels": {SERVICE_LABEL: name}}
    term = {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def tiny_example(model_dir: Path, name: str | None = None) -> dict[str, Any]:
    """examples/tiny-cpu.yaml as shipped, with its model folder moved to model_dir (made by make-model)."""
    manifest = yaml.safe_load(TINY_EXAMPLE.read_text())
    manifest["spec"]["model"]["uri"] = f"file://{model_dir}"
    if name is not None:
        manifest["metadata"]["name"] = name
    return manifest


def tiny_service(name: str, model_dir: Path, **sections: Mapping[str, Any]) -> dict[str, Any]:
    """A CPU model (the tiny one, unless `model` gives another's servedName), frugal for a shared 2-core
    machine: one thread, a small KV cache, short drains.

    `sections` override parts of the spec (engine=..., scaling=...), merged key by key (None removes a
    key: scaling={"replicas": None, "maxReplicas": 2} turns autoscaling on).
    """
    spec: dict[str, Any] = {
        "model": {"uri": f"file://{model_dir}", "servedName": "tiny", "hostPath": True},
        "engine": {
            "dtype": "float32",
            "maxNumSeqs": 4,
            "maxModelLen": 512,
            "drainTimeoutSeconds": 5,
            "startupTimeoutSeconds": 120,
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
            "extraArgs": ["--cpu-kv-cache-space", "0.0625"],
        },
        "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
        "scaling": {"replicas": 1},
        "sla": {"tier": "standard"},
    }
    return inference_service(name, _merged(spec, sections))


def fake_gpu_service(name: str, gpus: int = 1, **sections: Mapping[str, Any]) -> dict[str, Any]:
    """A GPU service whose pods kwok fakes: the scheduler places them on the fake nodes, no process runs."""
    spec: dict[str, Any] = {
        "model": {"uri": "file:///models/fake", "servedName": name},
        "engine": {"image": FAKE_RUNTIME_IMAGE, "drainTimeoutSeconds": 0},
        "resources": {"gpus": gpus},
        "scaling": {"replicas": 1},
    }
    return inference_service(name, _merged(spec, sections))
