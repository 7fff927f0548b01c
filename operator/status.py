"""The InferenceService status: conditions by Kubernetes conventions, replica counts, the URL.

`Ready` rolls up the rest. Its reason tells tools such as the Argo CD health check what kind of
not-ready it is: still progressing, failed, or scaled down on purpose.
"""

from __future__ import annotations

import dataclasses
import datetime
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.contract.kv_transfer import Role
from kvfleet.operator.adapters import AdapterState, AdapterStatus
from kvfleet.operator.autoscaler import MetricsSample
from kvfleet.operator.observed import DeploymentView, PodView
from kvfleet.operator.safety import GuardState
from kvfleet.operator.schema import array, boolean, integer, number, obj, string

# Ready=False reasons that need a person (or a cluster change); the others resolve by waiting.
FAILURE_REASONS = frozenset(
    {
        "InvalidSpec",
        "InvalidModelURI",
        "ReconcileFailed",
        "ProgressDeadlineExceeded",
        "InsufficientGPU",
        "Unschedulable",
        "ReplicaFailing",
        "PodCreationFailed",
        "SafetyLoosened",
    }
)
SCALED_TO_ZERO = "ScaledToZero"
NAME_CONFLICT_REASON = "ServedNameTaken"
# The autoscaler found a latency target below what the replicas measure with no load to speak of.
TARGET_UNREACHABLE = "TargetUnreachable"
# Failures first seen through Ready; scheduling failures are reported through Scheduled, and spec and
# apply failures by the reconcile loop itself.
_READY_WARNINGS = frozenset({"ProgressDeadlineExceeded", "ReplicaFailing", "PodCreationFailed"})


_TIMESTAMP = {"type": "string", "format": "date-time"}
_GENERATION = {"type": "integer", "format": "int64"}
_CONDITION = obj(
    "",
    {
        "type": string(
            "Ready, WorkloadReady, Scheduled, ScalingActive, AdaptersReady, GroupsReady or NameConflict."
        ),
        "status": string("Whether the condition holds.", enum=["True", "False", "Unknown"]),
        "observedGeneration": {
            **_GENERATION,
            "description": "The spec generation the condition was set for.",
        },
        "lastTransitionTime": {**_TIMESTAMP, "description": "When the status last changed."},
        "reason": string(
            "Why, in one CamelCase word that tools can match (e.g. InsufficientGPU, ScaledToZero)."
        ),
        "message": string("Why, for a person."),
    },
    required=["type", "status", "lastTransitionTime", "reason", "message"],
)
_AUTOSCALER = obj(
    "The metrics the autoscaler last decided on (while autoscaling).",
    {
        "queueDepth": number(
            "The fleet's demand: requests running and waiting, estimated from the replicas that answered."
        ),
        "kvCacheUsage": number("The replicas' mean share of KV cache blocks in use, from 0 to 1."),
        "ttftMilliseconds": number("The replicas' mean time to first token."),
        "queuedPromptTokens": number(
            "The prompt tokens still to compute, estimated from the replicas that answered."
        ),
        "itlMilliseconds": number("The replicas' mean time between output tokens."),
        "reportingPods": integer("The replicas whose metrics were read."),
        "panic": boolean("Whether the autoscaler is in panic mode (a burst on the short window)."),
    },
)


def _role_schema(role: str, figures: str) -> dict[str, Any]:
    return obj(
        f"The {role} role's replicas.",
        {
            "desiredReplicas": integer(f"The {role} replicas the operator asks for."),
            "replicas": integer(f"The {role} replicas the role's Deployment runs, ready or not."),
            "readyReplicas": integer(f"The {role} replicas ready to serve."),
            "autoscaler": {**_AUTOSCALER, "description": figures},
        },
    )


# The CRD's schema of the status build_status writes.
STATUS_SCHEMA = obj(
    "What the operator last observed of the service.",
    {
        "observedGeneration": {**_GENERATION, "description": "The spec generation this status describes."},
        "desiredReplicas": integer(
            "The replicas the operator asks for: the fixed count or the autoscaler's."
        ),
        "replicas": integer("The replicas the workload runs, ready or not."),
        "readyReplicas": integer("The replicas ready to serve."),
        "url": string("The in-cluster URL of the service's OpenAI-compatible API."),
        "selector": string(
            "The label selector of the service's serving pods, one per replica, for the scale subresource "
            "(an HPA's pod metrics)."
        ),
        "lastScaleTime": {**_TIMESTAMP, "description": "When the autoscaler last changed the replica count."},
        "lastScaleReason": string("Why it did, as the autoscaler put it."),
        "autoscaler": _AUTOSCALER,
        "roles": obj(
            "Each role of a disaggregated service (spec.disaggregation); the counts above are their sums.",
            {
                "prefill": _role_schema(
                    "prefill",
                    "The metrics the autoscaler last decided the prefill role on (while autoscaling it): "
                    "the decode replicas' while no prefill replica is ready, since they compute every "
                    "prompt meanwhile.",
                ),
                "decode": _role_schema(
                    "decode",
                    "The metrics the autoscaler last decided the decode role on (while autoscaling it).",
                ),
            },
        ),
        "adapters": array(
            "Each LoRA adapter of spec.adapters and where it is served.",
            obj(
                "",
                {
                    "name": string("The adapter's name."),
                    "state": string(
                        "Pending (no replica ready), Loading, Ready (served by every ready replica) or "
                        "Failed.",
                        enum=list(typing.get_args(AdapterState)),
                    ),
                    "readyReplicas": integer("The ready replicas that serve it."),
                    "message": string("What is still missing or what failed."),
                },
            ),
        ),
        "safety": obj(
            "The state of what the safety policy depends on.",
            {
                "guard": obj(
                    "The guard model's InferenceService (spec.safety.guard.service).",
                    {
                        "service": string("Its name."),
                        "state": string(
                            "Ready, Unavailable (no replica ready) or NotFound.",
                            enum=[state.value for state in GuardState],
                        ),
                    },
                )
            },
        ),
        "groups": array(
            "Each replica group of a model that spans nodes, with its ranks ready.",
            obj(
                "",
                {
                    "name": string("The group's name (its StatefulSet's)."),
                    "ranks": integer("The group's pods, one per node."),
                    "ranksReady": integer("Of those, the ready ones."),
                },
            ),
        ),
        "conditions": array(
            "The service's conditions, by Kubernetes conventions; Ready rolls up the rest.",
            _CONDITION,
            **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        ),
    },
)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class GroupStatus:
    """One replica group of a model that spans nodes: its pods ready out of its ranks (one pod per node)."""

    name: str
    ranks: int
    ranks_ready: int


@dataclass(frozen=True)
class RoleObservation:
    """One role of a disaggregated service: its Deployment and what its autoscaler last saw."""

    role: Role
    autoscaling: bool
    desired_replicas: int
    deployment: DeploymentView | None
    gpu_resource_name: str = "nvidia.com/gpu"
    latest_sample: MetricsSample | None = None
    panic: bool = False
    # A latency whose target the autoscaler found below the replicas' idle latency.
    unreachable: str | None = None


@dataclass(frozen=True)
class Observation:
    """Everything one status update is computed from. A disaggregated service's workload is its `roles`
    (`deployment`, `desired_replicas`, `autoscaling`, `latest_sample` and `panic` are then unused)."""

    generation: int
    url: str
    # The scale subresource's label selector (kvfleet.operator.render.replica_selector).
    selector: str
    autoscaling: bool
    desired_replicas: int
    deployment: DeploymentView | None
    pods: Sequence[PodView]
    gpu_resource_name: str
    # A reason and message when the spec cannot be rendered or applying it failed.
    blocking_error: tuple[str, str] | None = None
    latest_sample: MetricsSample | None = None
    panic: bool = False
    # A latency whose target the autoscaler found below the replicas' idle latency.
    unreachable: str | None = None
    last_scale_time: str | None = None
    last_scale_reason: str | None = None
    # Each LoRA adapter's state; None when the service serves none.
    adapters: Sequence[AdapterStatus] | None = None
    # The guard model's InferenceService (spec.safety.guard.service) and its state.
    guard: tuple[str, str] | None = None
    # Each replica group's ranks, for a model that spans nodes; None for one pod per replica.
    groups: Sequence[GroupStatus] | None = None
    # While another service of the namespace owns the served name.
    name_conflict: Condition | None = None
    roles: Sequence[RoleObservation] | None = None


def build_status(
    observation: Observation, previous: Mapping[str, Any], now: datetime.datetime
) -> dict[str, Any]:
    roles = observation.roles
    workload = workload_condition(observation) if roles is None else roles_condition(observation, roles)
    conditions = [
        ready_condition(observation, workload),
        workload,
        scheduled_condition(observation),
        scaling_condition(observation),
    ]
    if observation.adapters is not None:
        conditions.append(adapters_condition(observation.adapters))
    if observation.groups is not None:
        conditions.append(groups_condition(observation.groups))
    if observation.name_conflict is not None:
        conditions.append(observation.name_conflict)
    workloads = (
        [(observation.desired_replicas, observation.deployment)]
        if roles is None
        else [(role.desired_replicas, role.deployment) for role in roles]
    )
    status: dict[str, Any] = {
        "observedGeneration": observation.generation,
        "desiredReplicas": sum(desired for desired, _ in workloads),
        "replicas": sum(deployment.status_replicas for _, deployment in workloads if deployment),
        "readyReplicas": sum(deployment.ready_replicas for _, deployment in workloads if deployment),
        "url": observation.url,
        "selector": observation.selector,
        "conditions": merge_conditions(
            previous.get("conditions") or [], conditions, observation.generation, now
        ),
    }
    if observation.adapters is not None:
        status["adapters"] = [
            {
                "name": adapter.name,
                "state": adapter.state,
                "readyReplicas": adapter.ready_replicas,
                **({"message": adapter.message} if adapter.message else {}),
            }
            for adapter in observation.adapters
        ]
    if observation.groups is not None:
        status["groups"] = [
            {"name": group.name, "ranks": group.ranks, "ranksReady": group.ranks_ready}
            for group in observation.groups
        ]
    if observation.guard is not None:
        service, state = observation.guard
        status["safety"] = {"guard": {"service": service, "state": state}}
    if observation.last_scale_time is not None:
        status["lastScaleTime"] = observation.last_scale_time
        status["lastScaleReason"] = observation.last_scale_reason or ""
    sample = observation.latest_sample
    if roles is not None:
        status["roles"] = {role.role: _role_status(role) for role in roles}
    elif observation.autoscaling and sample is not None:
        status["autoscaler"] = _autoscaler_figures(sample, observation.panic)
    return status


def _role_status(role: RoleObservation) -> dict[str, Any]:
    deployment = role.deployment
    status: dict[str, Any] = {
        "desiredReplicas": role.desired_replicas,
        "replicas": deployment.status_replicas if deployment else 0,
        "readyReplicas": deployment.ready_replicas if deployment else 0,
    }
    if role.autoscaling and role.latest_sample is not None:
        status["autoscaler"] = _autoscaler_figures(role.latest_sample, role.panic)
    return status


def _autoscaler_figures(sample: MetricsSample, panic: bool) -> dict[str, Any]:
    autoscaler: dict[str, Any] = {
        "queueDepth": round(sample.queue_depth, 1),
        "reportingPods": sample.reporting_pods,
        "panic": panic,
    }
    if sample.kv_cache_usage is not None:
        autoscaler["kvCacheUsage"] = round(sample.kv_cache_usage, 3)
    if sample.ttft_seconds is not None:
        autoscaler["ttftMilliseconds"] = round(sample.ttft_seconds * 1000, 1)
    if sample.queued_prompt_tokens is not None:
        autoscaler["queuedPromptTokens"] = round(sample.queued_prompt_tokens, 1)
    if sample.itl_seconds is not None:
        autoscaler["itlMilliseconds"] = round(sample.itl_seconds * 1000, 1)
    return autoscaler


def workload_condition(observation: Observation) -> Condition:
    deployment, desired = observation.deployment, observation.desired_replicas

    def condition(status: bool, reason: str, message: str) -> Condition:
        return Condition("WorkloadReady", "True" if status else "False", reason, message)

    if deployment is None:
        return condition(False, "DeploymentPending", "the Deployment has not been created yet")
    if desired == 0 and observation.autoscaling:
        # Idle on purpose and ready to serve: the gateway holds the next request while a replica starts.
        return condition(
            True,
            SCALED_TO_ZERO,
            "scaled to zero while idle; the next request through the gateway scales it up",
        )
    if desired == 0:
        return condition(False, SCALED_TO_ZERO, "spec.scaling.replicas is 0")
    if deployment.observed_generation < deployment.generation:
        return condition(False, "RollingOut", "the Deployment controller has not seen the latest template")
    if deployment.replica_failure is not None and deployment.available_replicas < desired:
        return condition(False, "PodCreationFailed", deployment.replica_failure)
    if deployment.progress_deadline_exceeded:
        return condition(False, "ProgressDeadlineExceeded", deployment.progress_message)
    if deployment.available_replicas == 0:
        # Nothing serves: say why, even mid-rollout, since waiting will not fix a failing or unplaceable pod.
        failing = next((pod for pod in observation.pods if pod.failure_reason), None)
        if failing is not None:
            return condition(False, "ReplicaFailing", f"pod {failing.name}: {failing.failure_message}")
        unschedulable = _unschedulable(observation.pods)
        if unschedulable:
            reason, message = _unschedulable_reason(unschedulable, observation.gpu_resource_name)
            return condition(False, reason, message)
    rolled_out = deployment.updated_replicas >= deployment.replicas
    old_left = deployment.status_replicas - deployment.updated_replicas
    if not rolled_out or old_left > 0:
        return condition(
            False,
            "RollingOut",
            f"{deployment.updated_replicas} of {deployment.replicas} replicas updated, {old_left} old left",
        )
    if deployment.available_replicas == 0:
        return condition(
            False, "ReplicasStarting", f"0 of {desired} replicas ready; waiting for the model to load"
        )
    return condition(True, "Available", f"{deployment.ready_replicas} of {desired} replicas ready")


def roles_condition(observation: Observation, roles: Sequence[RoleObservation]) -> Condition:
    """A disaggregated service's workload: ready when both roles are. A prefill role at zero is no
    obstacle (the decode replicas compute prompts themselves meanwhile). Of the roles not ready, one that
    failed speaks first."""
    conditions = {}
    for role in roles:
        if role.role == "prefill" and role.desired_replicas == 0:
            conditions[role.role] = Condition(
                "WorkloadReady", "True", SCALED_TO_ZERO, "at zero: the decode replicas compute prompts"
            )
            continue
        pods = [pod for pod in observation.pods if pod.role == role.role]
        conditions[role.role] = workload_condition(
            dataclasses.replace(
                observation,
                autoscaling=role.autoscaling,
                desired_replicas=role.desired_replicas,
                deployment=role.deployment,
                pods=pods,
                gpu_resource_name=role.gpu_resource_name,
            )
        )
    waiting = [(role, c) for role, c in conditions.items() if c.status != "True"]
    failed = [(role, c) for role, c in waiting if c.reason in FAILURE_REASONS]
    if failed or waiting:
        role, condition = (failed or waiting)[0]
        return dataclasses.replace(condition, message=f"{role}: {condition.message}")
    message = "; ".join(f"{role}: {condition.message}" for role, condition in conditions.items())
    decode = conditions.get("decode")
    reason = SCALED_TO_ZERO if decode is not None and decode.reason == SCALED_TO_ZERO else "Available"
    return Condition("WorkloadReady", "True", reason, message)


def ready_condition(observation: Observation, workload: Condition) -> Condition:
    if observation.blocking_error is not None:
        reason, message = observation.blocking_error
        return Condition("Ready", "False", reason, message)
    return Condition("Ready", workload.status, workload.reason, workload.message)


def scheduled_condition(observation: Observation) -> Condition:
    unschedulable = _unschedulable(observation.pods)
    if not unschedulable:
        return Condition("Scheduled", "True", "AllReplicasScheduled", "every replica has a node")
    reason, message = _unschedulable_reason(unschedulable, observation.gpu_resource_name)
    return Condition("Scheduled", "False", reason, message)


def scaling_condition(observation: Observation) -> Condition:
    if observation.roles is not None:
        return _roles_scaling_condition(observation.roles)
    if not observation.autoscaling:
        return Condition("ScalingActive", "False", "AutoscalingDisabled", "spec.scaling.replicas is set")
    sample = observation.latest_sample
    if sample is None:
        return Condition(
            "ScalingActive", "False", "MetricsUnavailable", "no ready replica has reported metrics"
        )
    if observation.unreachable is not None:
        return Condition("ScalingActive", "True", TARGET_UNREACHABLE, _unreachable(observation.unreachable))
    # No live figures in the message: they would rewrite the status on every scrape.
    message = f"{sample.reporting_pods} replica(s) reporting" + (", panic mode" if observation.panic else "")
    return Condition("ScalingActive", "True", "MetricsAvailable", message)


def _unreachable(latency: str) -> str:
    # The figures are in lastScaleReason: here they would rewrite the status on every scrape.
    return (
        f"the {latency} target is below the replicas' {latency} at the least load: no replica count meets "
        "it (spec.sla; the figures are in lastScaleReason)"
    )


def _roles_scaling_condition(roles: Sequence[RoleObservation]) -> Condition:
    autoscaled = [role for role in roles if role.autoscaling]
    if not autoscaled:
        return Condition(
            "ScalingActive", "False", "AutoscalingDisabled", "every role's scaling.replicas is set"
        )
    silent = [role.role for role in autoscaled if role.latest_sample is None]
    if silent:
        message = f"no ready replica has reported metrics for the {' and '.join(silent)} role"
        return Condition("ScalingActive", "False", "MetricsUnavailable", message)
    unreachable = [role for role in autoscaled if role.unreachable is not None]
    if unreachable:
        message = "; ".join(f"{role.role}: {_unreachable(str(role.unreachable))}" for role in unreachable)
        return Condition("ScalingActive", "True", TARGET_UNREACHABLE, message)
    # No live figures in the message: they would rewrite the status on every scrape.
    message = "; ".join(
        f"{role.role}: {role.latest_sample.reporting_pods} replica(s) reporting"
        + (", panic mode" if role.panic else "")
        for role in autoscaled
        if role.latest_sample is not None
    )
    return Condition("ScalingActive", "True", "MetricsAvailable", message)


def adapters_condition(adapters: Sequence[AdapterStatus]) -> Condition:
    def condition(ready: bool, reason: str, message: str) -> Condition:
        return Condition("AdaptersReady", "True" if ready else "False", reason, message)

    failed = [adapter for adapter in adapters if adapter.state == "Failed"]
    if failed:
        return condition(
            False, "AdapterLoadFailed", "; ".join(f"{adapter.name}: {adapter.message}" for adapter in failed)
        )
    waiting = [adapter.name for adapter in adapters if adapter.state != "Ready"]
    if waiting:
        return condition(
            False, "AdaptersLoading", f"not yet served by every ready replica: {', '.join(waiting)}"
        )
    return condition(True, "AdaptersLoaded", f"{len(adapters)} adapter(s) served by every ready replica")


def groups_condition(groups: Sequence[GroupStatus]) -> Condition:
    def condition(ready: bool, reason: str, message: str) -> Condition:
        return Condition("GroupsReady", "True" if ready else "False", reason, message)

    waiting = [group for group in groups if group.ranks_ready < group.ranks]
    if waiting:
        return condition(
            False,
            "RanksStarting",
            "; ".join(f"{group.name}: {group.ranks_ready} of {group.ranks} ranks ready" for group in waiting),
        )
    return condition(True, "AllRanksReady", f"{len(groups)} group(s), every rank ready")


def transition_events(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events a change of conditions deserves."""
    before = {c.get("type"): c for c in previous}
    events = []
    for condition in current:
        old = before.get(condition["type"], {})
        if (old.get("status"), old.get("reason")) == (condition["status"], condition["reason"]):
            continue
        kind, healthy, reason = condition["type"], condition["status"] == "True", condition["reason"]
        if kind == "Ready" and healthy:
            events.append(("Normal", "Ready", condition["message"]))
        elif (
            (kind == "Ready" and reason in _READY_WARNINGS)
            or (kind == "Scheduled" and not healthy)
            or reason == "AdapterLoadFailed"
        ):
            events.append(("Warning", reason, condition["message"]))
    return events


def name_conflict_condition(served_name: str, owner: str) -> Condition:
    """Present only while the service is refused its served name (kvfleet.operator.api.claim_order)."""
    return Condition(
        "NameConflict",
        "True",
        NAME_CONFLICT_REASON,
        f"the served name {served_name!r} belongs to {owner!r}, the service of this namespace that claimed "
        "it first: the fleet gateway does not route this service (its own Service still serves it)",
    )


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    conditions: Sequence[Condition],
    generation: int,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Conditions as the API expects them; a transition time moves only when the status changes."""
    before = {c.get("type"): c for c in previous}
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    merged = []
    for condition in conditions:
        old = before.get(condition.type)
        changed = old is None or old.get("status") != condition.status
        merged.append(
            {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "observedGeneration": generation,
                "lastTransitionTime": stamp if changed else old.get("lastTransitionTime", stamp),
            }
        )
    return merged


def _unschedulable(pods: Sequence[PodView]) -> list[PodView]:
    return [pod for pod in pods if pod.unschedulable_message and not pod.terminating]


def _unschedulable_reason(pods: Sequence[PodView], gpu_resource_name: str) -> tuple[str, str]:
    message = pods[0].unschedulable_message or ""
    reason = "InsufficientGPU" if f"Insufficient {gpu_resource_name}" in message else "Unschedulable"
    return reason, f"{len(pods)} replica(s) pending: {message}"
