"""An InferenceService's children, rendered from its spec alone: Deployment, Service, PDB, ServiceMonitor.

A model that spans nodes runs each replica as a group of pods instead of a Deployment's pod: a StatefulSet per
group with a headless Service through which the ranks find rank 0, or one LeaderWorkerSet. A disaggregated
service runs a Deployment per role (prefill, decode), and its Service sends requests to the decode role.

Pure functions: the same inputs give the same manifests, which is what makes server-side apply
idempotent and the output golden-testable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.kv_transfer import ROLES, Role
from kvfleet.operator.api import (
    API_VERSION,
    COMPONENT,
    GROUP_LABEL,
    HTTP_PORT_NAME,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LWS_WORKER_INDEX_LABEL,
    MANAGED_BY,
    POD_INDEX_LABEL,
    RENDEZVOUS_PORT,
    ROLE_LABEL,
    SERVICE_LABEL,
    TIER_LABEL,
)
from kvfleet.operator.render_pod import (
    RENDEZVOUS_PORT_NAME,
    GroupPlacement,
    TraceExport,
    batch_claim_name,
    pod_template,
)
from kvfleet.operator.safety import SafetyPlatform, safety_config
from kvfleet.operator.spec import InferenceServiceSpec, group_name, rendezvous_name, role_name
from kvfleet.operator.tiers import DEFAULT_PRIORITY_CLASS_PREFIX

DEFAULT_RUNTIME_IMAGE = "kvfleet/runtime:0.1.0"
# vLLM's own image (its OpenAI server; GPU build), for services with spec.engine.runtime vllm.
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
SERVICE_PORT = 80
# Room past the startup timeout for image pulls and model downloads before a rollout counts as failed.
ROLLOUT_SLACK_SECONDS = 600
# The replicas a service's workload runs: one count, or with disaggregation each role's.
Replicas = int | Mapping[Role, int]


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide settings that shape every service's manifests."""

    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    vllm_image: str = DEFAULT_VLLM_IMAGE
    cluster_domain: str = "cluster.local"
    service_monitor: bool = False
    # What the cluster's Prometheus selects ServiceMonitors by (chart value metrics.serviceMonitor.labels).
    service_monitor_labels: Mapping[str, str] = field(default_factory=dict)
    # The chart release's name, which prefixes its tiers' PriorityClasses.
    priority_class_prefix: str = DEFAULT_PRIORITY_CLASS_PREFIX
    # The platform's safety defaults and what services may loosen (chart values safety.*).
    safety: SafetyPlatform = field(default_factory=SafetyPlatform)
    # A node folder the runtime pods share their kernel builds in (chart value runtime.kernelCache.hostPath).
    kernel_cache_host_path: str | None = None
    # Where the runtime pods send their requests' spans (chart values runtime.tracing.*); None: nowhere.
    traces: TraceExport | None = None


@dataclass(frozen=True)
class Owner:
    """The InferenceService whose children are rendered."""

    name: str
    namespace: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    return {SERVICE_LABEL: name}


def serving_selector(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """The pods that serve the OpenAI API: every replica's pod, rank 0 of every group, or the decode role's
    pods (a decode replica computes a prompt itself when it is sent no KV)."""
    if spec.disaggregation is not None:
        return {**selector_labels(name), ROLE_LABEL: "decode"}
    if not spec.grouped:
        return selector_labels(name)
    rank_label = POD_INDEX_LABEL if spec.scaling.group_backend == "statefulset" else LWS_WORKER_INDEX_LABEL
    return {**selector_labels(name), rank_label: "0"}


def replica_selector(name: str, spec: InferenceServiceSpec | None) -> str:
    """The label selector of the scale subresource, one pod per replica (the serving pods), in its string
    form; every pod of the service while its spec cannot be read."""
    labels = serving_selector(name, spec) if spec is not None else selector_labels(name)
    return ",".join(f"{key}={value}" for key, value in labels.items())


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
    owner: Owner, spec: InferenceServiceSpec, replicas: Replicas, options: RenderOptions
) -> list[dict[str, Any]]:
    """Every child object, in apply order: the Deployment first, because its pods take longest to become
    ready (and under a burst of new services each apply waits in line behind the others); the Service is
    in place long before any pod is ready. A Batch API claim goes before the Deployment whose pods mount
    it. For a model that spans nodes, `replicas` counts groups; a disaggregated service has a Deployment
    per role, and `replicas` holds each role's count."""
    if spec.disaggregation is not None:
        assert isinstance(replicas, Mapping), "a disaggregated service is given each role's replicas"
        workload = [render_role_deployment(owner, spec, role, replicas[role], options) for role in ROLES]
    else:
        assert isinstance(replicas, int), "a service without roles is given one replica count"
        workload = _colocated_workload(owner, spec, replicas, options)
    children = [*workload, render_service(owner, spec), render_disruption_budget(owner, spec)]
    if spec.batch is not None and spec.batch.storage == "PersistentVolumeClaim":
        children.insert(0, render_batch_claim(owner, spec))
    if options.service_monitor:
        children.append(render_service_monitor(owner, spec, options.service_monitor_labels))
    return children


def _colocated_workload(
    owner: Owner, spec: InferenceServiceSpec, replicas: int, options: RenderOptions
) -> list[dict[str, Any]]:
    """Each replica a Deployment's pod, or a group of pods: a StatefulSet each, or one LeaderWorkerSet."""
    if not spec.grouped:
        return [render_deployment(owner, spec, replicas, options)]
    if spec.scaling.group_backend == "statefulset":
        groups = [render_group(owner, spec, index, options) for index in range(replicas)]
        return [*groups, render_rendezvous_service(owner, spec)]
    return [render_leader_worker_set(owner, spec, replicas, options)]


def render_deployment(
    owner: Owner, spec: InferenceServiceSpec, replicas: int, options: RenderOptions
) -> dict[str, Any]:
    labels = common_labels(owner, spec)
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
            "template": _pod_template(owner, spec, labels, options),
        },
    }


def render_role_deployment(
    owner: Owner, spec: InferenceServiceSpec, role: Role, replicas: int, options: RenderOptions
) -> dict[str, Any]:
    """The Deployment of one role of a disaggregated service: its pods carry the role's label, by which the
    gateway and the Service tell prefill from decode, and run the role's side of the KV connector."""
    role_labels = {ROLE_LABEL: role}
    labels = {**common_labels(owner, spec), **role_labels}
    metadata = _metadata(owner, labels)
    metadata["name"] = role_name(owner.name, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {**selector_labels(owner.name), **role_labels}},
            # Never below current capacity, as the colocated Deployment's rollouts.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec.engine.startup_timeout_seconds + ROLLOUT_SLACK_SECONDS,
            "template": _pod_template(owner, spec.for_role(role), labels, options, role=role),
        },
    }


def render_group(
    owner: Owner, spec: InferenceServiceSpec, index: int, options: RenderOptions
) -> dict[str, Any]:
    """One replica group: a StatefulSet whose pod ordinals are the node ranks.

    Its pods start together (Parallel) and find rank 0 by its stable name under the headless Service. The
    operator, not the StatefulSet, replaces a group's pods when the template changes (OnDelete): a rolling
    update pod by pod would pair ranks of two templates in one group.
    """
    name = group_name(owner.name, "statefulset", index)
    group_labels = {GROUP_LABEL: str(index)}
    labels = {**common_labels(owner, spec), **group_labels}
    master = f"{name}-0.{rendezvous_name(owner.name)}.{owner.namespace}.svc.{options.cluster_domain}"
    placement = GroupPlacement(spec.resources.nodes, master, POD_INDEX_LABEL)
    metadata = _metadata(owner, labels)
    metadata["name"] = name
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "replicas": spec.resources.nodes,
            "serviceName": rendezvous_name(owner.name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": {**selector_labels(owner.name), **group_labels}},
            "revisionHistoryLimit": 3,
            "template": _pod_template(owner, spec, labels, options, placement),
        },
    }


def render_rendezvous_service(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The headless Service that gives each group's pods stable DNS names; it lists pods before they are
    ready, since the ranks meet before any of them is."""
    metadata = _metadata(owner, common_labels(owner, spec))
    metadata["name"] = rendezvous_name(owner.name)
    port = {"name": RENDEZVOUS_PORT_NAME, "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT_NAME}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name),
            "ports": [{**port, "protocol": "TCP"}],
        },
    }


def render_leader_worker_set(
    owner: Owner, spec: InferenceServiceSpec, replicas: int, options: RenderOptions
) -> dict[str, Any]:
    """Every group as one LeaderWorkerSet: its controller starts, restarts and rolls groups as a whole, and
    tells each pod its leader's address (LWS_LEADER_ADDRESS)."""
    labels = common_labels(owner, spec)
    metadata = _metadata(owner, labels)
    metadata["name"] = rendezvous_name(owner.name)

    def template(readiness_path: str) -> dict[str, Any]:
        placement = GroupPlacement(
            spec.resources.nodes, "$(LWS_LEADER_ADDRESS)", LWS_WORKER_INDEX_LABEL, readiness_path
        )
        return _pod_template(owner, spec, labels, options, placement)

    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            # Never below current capacity, as the Deployment's rollouts.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": spec.resources.nodes,
                # A rank lost breaks the group's collectives: every pod of the group starts again.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("/ready"),
                "workerTemplate": template("/health"),
            },
        },
    }


def _pod_template(
    owner: Owner,
    spec: InferenceServiceSpec,
    labels: dict[str, str],
    options: RenderOptions,
    group: GroupPlacement | None = None,
    role: Role | None = None,
) -> dict[str, Any]:
    default_image = options.vllm_image if spec.engine.runtime == "vllm" else options.runtime_image
    image = spec.engine.image or default_image
    safety = safety_config(options.safety, spec.safety, owner.namespace, options.cluster_domain)
    # An hf:// model is fetched by kvfleet's `download-model`, which vLLM's image does not have; vLLM builds
    # no kvfleet kernels, so its pods get no kernel cache.
    kvfleet_runtime = spec.engine.runtime == "kvfleet"
    return pod_template(
        spec,
        labels,
        image,
        owner.name,
        safety,
        group,
        role,
        options.priority_class_prefix,
        download_image=image if kvfleet_runtime else options.runtime_image,
        kernel_cache_host_path=options.kernel_cache_host_path if kvfleet_runtime else None,
        traces=options.traces,
    )


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
            "selector": serving_selector(owner.name, spec),
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


def render_service_monitor(
    owner: Owner, spec: InferenceServiceSpec, extra_labels: Mapping[str, str]
) -> dict[str, Any]:
    """`extra_labels`: what the cluster's Prometheus selects ServiceMonitors by; the service's own labels win
    where they meet."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(owner, {**extra_labels, **common_labels(owner, spec)}),
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
