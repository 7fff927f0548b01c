"""An InferenceService's children, rendered from its spec alone: Deployment, Service, PDB, ServiceMonitor.

Pure functions: the same inputs give the same manifests, which is what makes server-side apply
idempotent and the output golden-testable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.api import (
    API_VERSION,
    COMPONENT,
    HTTP_PORT_NAME,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    SERVICE_LABEL,
    TIER_LABEL,
)
from kvfleet.operator.render_pod import batch_claim_name, pod_template
from kvfleet.operator.safety import SafetyPlatform, safety_config
from kvfleet.operator.spec import InferenceServiceSpec

DEFAULT_RUNTIME_IMAGE = "kvfleet/runtime:0.1.0"
SERVICE_PORT = 80
# Room past the startup timeout for image pulls and model downloads before a rollout counts as failed.
ROLLOUT_SLACK_SECONDS = 600


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide settings that shape every service's manifests."""

    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    cluster_domain: str = "cluster.local"
    service_monitor: bool = False
    # The platform's safety defaults and what services may loosen (chart values safety.*).
    safety: SafetyPlatform = field(default_factory=SafetyPlatform)


@dataclass(frozen=True)
class Owner:
    """The InferenceService whose children are rendered."""

    name: str
    namespace: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    return {SERVICE_LABEL: name}


def common_labels(owner: Owner, spec: InferenceServiceSpec) -> dict[str, str]:
    return {
        LABEL_NAME: "kvfleet",
        LABEL_INSTANCE: owner.name,
        LABEL_COMPONENT: COMPONENT,
        LABEL_MANAGED_BY: MANAGED_BY,
        TIER_LABEL: spec.sla.tier,
        **selector_labels(owner.name),
    }


def service_url(owner: Owner, options: RenderOptions) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc.{options.cluster_domain}"


def render_children(
    owner: Owner, spec: InferenceServiceSpec, replicas: int, options: RenderOptions
) -> list[dict[str, Any]]:
    """Every child object, in apply order: the Deployment first, because its pods take longest to become
    ready (and under a burst of new services each apply waits in line behind the others); the Service is
    in place long before any pod is ready. A Batch API claim goes before the Deployment whose pods mount
    it."""
    children = [
        render_deployment(owner, spec, replicas, options),
        render_service(owner, spec),
        render_disruption_budget(owner, spec),
    ]
    if spec.batch is not None and spec.batch.storage == "PersistentVolumeClaim":
        children.insert(0, render_batch_claim(owner, spec))
    if options.service_monitor:
        children.append(render_service_monitor(owner, spec))
    return children


def render_deployment(
    owner: Owner, spec: InferenceServiceSpec, replicas: int, options: RenderOptions
) -> dict[str, Any]:
    labels = common_labels(owner, spec)
    image = spec.engine.image or options.runtime_image
    if spec.batch is not None:
        # One store, one writer: the old pod stops before the new one opens the store.
        strategy: dict[str, Any] = {"type": "Recreate"}
    else:
        # Never below current capacity: a new replica must be ready before an old one stops.
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": strategy,
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec.engine.startup_timeout_seconds + ROLLOUT_SLACK_SECONDS,
            "template": pod_template(
                spec,
                labels,
                image,
                owner.name,
                safety_config(options.safety, spec.safety, owner.namespace, options.cluster_domain),
            ),
        },
    }


def render_batch_claim(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Batch API's store: owned by the service, so deleting the service deletes its batches."""
    batch = spec.batch
    assert batch is not None
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": batch.claim_size}},
    }
    if batch.storage_class_name is not None:
        claim["storageClassName"] = batch.storage_class_name
    metadata = _metadata(owner, common_labels(owner, spec))
    metadata["name"] = batch_claim_name(owner.name)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": claim}


def render_service(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, common_labels(owner, spec)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": SERVICE_PORT,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def render_disruption_budget(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, common_labels(owner, spec)),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            # One replica at a time, so node drains proceed without emptying the service.
            "maxUnavailable": 1,
            # A replica that is not ready serves nothing: evicting it must not be blocked.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_service_monitor(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(owner, common_labels(owner, spec)),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "endpoints": [{"port": HTTP_PORT_NAME, "path": "/metrics", "interval": "15s"}],
        },
    }


def _metadata(owner: Owner, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": dict(labels),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
