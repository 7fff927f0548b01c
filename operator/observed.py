"""Compact views of the pods and Deployments the operator watches.

The watch indexes keep these instead of whole objects: a fleet of hundreds of services stays small in
memory, and status and scaling read only what they need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.kv_transfer import Role
from kvfleet.operator.api import REVISION_LABEL, ROLE_LABEL, group_index, node_rank

# Container waiting reasons after which a replica will not come up without a change.
FAILING_WAIT_REASONS = frozenset(
    {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError"}
)


@dataclass(frozen=True)
class PodView:
    name: str
    ip: str | None
    ready: bool
    terminating: bool
    # The scheduler's message when it found no node for the pod.
    unschedulable_message: str | None = None
    # Why a container is not running, when that reason means it will not recover by itself.
    failure_reason: str | None = None
    failure_message: str | None = None
    # For a pod of a replica group (a model that spans nodes): which group, and its node rank there.
    group: int | None = None
    rank: int | None = None
    # The revision of the StatefulSet template a group's pod was made from.
    revision: str | None = None
    # The role of a disaggregated service's replica (its label's value).
    role: str | None = None

    @property
    def scrapeable(self) -> bool:
        """Ready to answer metrics and adapter calls: whole replicas, and rank 0 of groups, serve the API."""
        return self.ready and not self.terminating and self.ip is not None and self.rank in (None, 0)


@dataclass(frozen=True)
class DeploymentView:
    generation: int
    observed_generation: int
    replicas: int
    status_replicas: int
    updated_replicas: int
    ready_replicas: int
    available_replicas: int
    progress_deadline_exceeded: bool = False
    progress_message: str = ""
    # Why the Deployment could not create pods (a missing PriorityClass, an exhausted quota...).
    replica_failure: str | None = None
    # The controlling owner's uid: a Deployment left by a deleted namesake must not count.
    owner_uid: str | None = None
    # The role of a disaggregated service's Deployment (its label's value); None for a colocated one.
    role: str | None = None


@dataclass(frozen=True)
class StatefulSetView:
    """A replica group's StatefulSet."""

    name: str
    # The group's index (its label); None for a StatefulSet the operator did not label as a group.
    group: int | None
    generation: int
    observed_generation: int
    replicas: int
    ready_replicas: int
    # Pods at the current template's revision.
    updated_replicas: int
    update_revision: str
    owner_uid: str | None = None

    @property
    def rolled_out(self) -> bool:
        return self.observed_generation >= self.generation and self.updated_replicas >= self.replicas


def pod_view(body: Mapping[str, Any]) -> PodView:
    meta, status = body.get("metadata", {}), body.get("status", {})
    labels = meta.get("labels") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "no node fits the pod"
    failure_reason = failure_message = None
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILING_WAIT_REASONS:
            failure_reason = waiting["reason"]
            failure_message = (
                f"container {container.get('name')}: {waiting.get('message') or waiting['reason']}"
            )
            break
    return PodView(
        name=meta.get("name", ""),
        ip=status.get("podIP") or None,
        ready=conditions.get("Ready", {}).get("status") == "True",
        terminating=meta.get("deletionTimestamp") is not None,
        unschedulable_message=unschedulable,
        failure_reason=failure_reason,
        failure_message=failure_message,
        group=group_index(labels),
        rank=node_rank(labels),
        revision=labels.get(REVISION_LABEL),
        role=labels.get(ROLE_LABEL),
    )


def deployment_view(body: Mapping[str, Any]) -> DeploymentView:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    progressing = next((c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {})
    failure = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "ReplicaFailure" and c.get("status") == "True"
        ),
        None,
    )
    return DeploymentView(
        generation=meta.get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        replicas=spec.get("replicas", 1),
        status_replicas=status.get("replicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        ready_replicas=status.get("readyReplicas", 0),
        available_replicas=status.get("availableReplicas", 0),
        progress_deadline_exceeded=progressing.get("reason") == "ProgressDeadlineExceeded",
        progress_message=progressing.get("message", ""),
        replica_failure=(failure.get("message") or failure.get("reason") or "") if failure else None,
        owner_uid=_controller_uid(meta),
        role=(meta.get("labels") or {}).get(ROLE_LABEL),
    )


def leader_worker_set_view(body: Mapping[str, Any]) -> DeploymentView:
    """A LeaderWorkerSet read as a Deployment of groups: its counts are groups, as the operator's replicas."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return DeploymentView(
        generation=meta.get("generation", 0),
        # Its status carries no observedGeneration: a status at all means its controller has seen it.
        observed_generation=meta.get("generation", 0) if status else 0,
        replicas=spec.get("replicas", 1),
        status_replicas=status.get("replicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        ready_replicas=status.get("readyReplicas", 0),
        available_replicas=status.get("readyReplicas", 0),
        owner_uid=_controller_uid(meta),
    )


def stateful_set_view(body: Mapping[str, Any]) -> StatefulSetView:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return StatefulSetView(
        name=meta.get("name", ""),
        group=group_index(meta.get("labels") or {}),
        generation=meta.get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        replicas=spec.get("replicas", 1),
        ready_replicas=status.get("readyReplicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        update_revision=status.get("updateRevision", ""),
        owner_uid=_controller_uid(meta),
    )


def _controller_uid(meta: Mapping[str, Any]) -> str | None:
    controller = next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), {})
    return controller.get("uid")


@dataclass(frozen=True)
class Observed:
    """What the watch indexes hold for one service: its workload objects and pods."""

    deployment: DeploymentView | None
    pods: list[PodView]
    # The groups of a model that spans nodes: a StatefulSet each, or one LeaderWorkerSet.
    stateful_sets: tuple[StatefulSetView, ...] = ()
    leader_worker_set: DeploymentView | None = None
    # The Deployment of each role of a disaggregated service.
    roles: Mapping[Role, DeploymentView] = field(default_factory=dict)
