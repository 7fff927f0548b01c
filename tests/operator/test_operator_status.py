"""Status: conditions from observed pods and Deployments, and their transition times."""

from __future__ import annotations

import datetime
from dataclasses import replace
from typing import Any

from kvfleet.operator.api import ROLE_LABEL
from kvfleet.operator.autoscaler import MetricsSample
from kvfleet.operator.observed import (
    DeploymentView,
    PodView,
    StatefulSetView,
    deployment_view,
    pod_view,
    stateful_set_view,
)
from kvfleet.operator.status import FAILURE_REASONS, GroupStatus, Observation, RoleObservation, build_status

NOW = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
LATER = NOW + datetime.timedelta(minutes=5)
GPU_MESSAGE = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: not eligible"


def deployment(**changes: Any) -> DeploymentView:
    base = DeploymentView(
        generation=2,
        observed_generation=2,
        replicas=2,
        status_replicas=2,
        updated_replicas=2,
        ready_replicas=2,
        available_replicas=2,
    )
    return replace(base, **changes)


def observe(**changes: Any) -> Observation:
    base = Observation(
        generation=3,
        url="http://svc.ns.svc.cluster.local",
        selector="kvfleet.dev/inference-service=svc",
        autoscaling=True,
        desired_replicas=2,
        deployment=deployment(),
        pods=[
            PodView("svc-a", "10.0.0.1", True, False),
            PodView("svc-b", "10.0.0.2", True, False),
        ],
        gpu_resource_name="nvidia.com/gpu",
        latest_sample=MetricsSample(time=1.0, queue_depth=12.34, reporting_pods=2, kv_cache_usage=0.5),
    )
    return replace(base, **changes)


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_ready_fleet() -> None:
    status = build_status(observe(), {}, NOW)
    assert status["observedGeneration"] == 3
    assert (status["desiredReplicas"], status["readyReplicas"], status["replicas"]) == (2, 2, 2)
    assert status["url"] == "http://svc.ns.svc.cluster.local"
    got = conditions(status)
    assert [c["type"] for c in status["conditions"]] == [
        "Ready",
        "WorkloadReady",
        "Scheduled",
        "ScalingActive",
    ]
    assert got["Ready"]["status"] == "True" and got["Ready"]["reason"] == "Available"
    assert got["Scheduled"]["status"] == "True"
    assert got["ScalingActive"]["status"] == "True"
    for condition in status["conditions"]:
        assert condition["observedGeneration"] == 3
        assert condition["lastTransitionTime"] == "2025-01-02T03:04:05Z"
        assert set(condition) == {
            "type",
            "status",
            "reason",
            "message",
            "observedGeneration",
            "lastTransitionTime",
        }
    assert status["autoscaler"] == {
        "queueDepth": 12.3,
        "reportingPods": 2,
        "panic": False,
        "kvCacheUsage": 0.5,
    }


def test_transition_time_moves_only_when_status_changes() -> None:
    first = build_status(observe(), {}, NOW)
    same = build_status(observe(latest_sample=None), first, LATER)
    assert conditions(same)["Ready"]["lastTransitionTime"] == "2025-01-02T03:04:05Z"
    assert conditions(same)["ScalingActive"]["lastTransitionTime"] == "2025-01-02T03:09:05Z"
    assert conditions(same)["ScalingActive"]["reason"] == "MetricsUnavailable"


def test_pending_for_gpus() -> None:
    pending = PodView("svc-c", None, False, False, unschedulable_message=GPU_MESSAGE)
    observation = observe(
        desired_replicas=3, deployment=deployment(replicas=3, status_replicas=3, updated_replicas=3)
    )
    status = build_status(replace(observation, pods=[*observation.pods, pending]), {}, NOW)
    scheduled = conditions(status)["Scheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("False", "InsufficientGPU")
    assert "1 replica(s) pending: 0/4 nodes are available" in scheduled["message"]
    assert conditions(status)["Ready"]["status"] == "True", "serving replicas keep the service ready"


def test_nothing_placed_is_a_failure() -> None:
    pods = [PodView("svc-a", None, False, False, unschedulable_message=GPU_MESSAGE)]
    status = build_status(
        observe(pods=pods, deployment=deployment(ready_replicas=0, available_replicas=0)), {}, NOW
    )
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InsufficientGPU")
    assert ready["reason"] in FAILURE_REASONS


def test_a_rollout_that_cannot_place_anything_is_a_failure() -> None:
    # A claim that does not exist: old and new replicas both pending, nothing serving.
    message = '0/2 nodes are available: persistentvolumeclaim "model-store" not found.'
    pods = [PodView(name, None, False, False, unschedulable_message=message) for name in ("old", "new")]
    stuck = deployment(updated_replicas=1, status_replicas=2, ready_replicas=0, available_replicas=0)
    ready = conditions(build_status(observe(pods=pods, deployment=stuck), {}, NOW))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert "persistentvolumeclaim" in ready["message"]


def test_other_unschedulable_reasons() -> None:
    pods = [PodView("svc-a", None, False, False, unschedulable_message="0/4 nodes: node(s) had taint")]
    status = build_status(observe(pods=pods), {}, NOW)
    assert conditions(status)["Scheduled"]["reason"] == "Unschedulable"


def test_rollout_and_stale_deployment_are_progressing() -> None:
    rolling = build_status(observe(deployment=deployment(updated_replicas=1, status_replicas=3)), {}, NOW)
    ready = conditions(rolling)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "RollingOut")
    assert "1 of 2 replicas updated" in ready["message"]
    stale = build_status(observe(deployment=deployment(generation=3)), {}, NOW)
    assert conditions(stale)["Ready"]["reason"] == "RollingOut"
    missing = build_status(observe(deployment=None), {}, NOW)
    assert conditions(missing)["Ready"]["reason"] == "DeploymentPending"
    assert missing["readyReplicas"] == 0


def test_starting_failing_and_stuck_replicas() -> None:
    none_ready = deployment(ready_replicas=0, available_replicas=0)
    starting = build_status(
        observe(deployment=none_ready, pods=[PodView("a", "10.0.0.1", False, False)]), {}, NOW
    )
    assert conditions(starting)["Ready"]["reason"] == "ReplicasStarting"
    crashing = PodView("a", "10.0.0.1", False, False, failure_reason="CrashLoopBackOff", failure_message="x")
    failing = build_status(observe(deployment=none_ready, pods=[crashing]), {}, NOW)
    assert conditions(failing)["Ready"]["reason"] == "ReplicaFailing"
    stuck = deployment(
        progress_deadline_exceeded=True, progress_message="ReplicaSet svc-1 has timed out progressing."
    )
    status = build_status(observe(deployment=stuck), {}, NOW)
    assert conditions(status)["Ready"]["reason"] == "ProgressDeadlineExceeded"


def test_pods_the_deployment_cannot_create() -> None:
    message = 'pods "svc-1" is forbidden: no PriorityClass with name kvfleet-standard was found'
    view = deployment(
        updated_replicas=0, status_replicas=0, ready_replicas=0, available_replicas=0, replica_failure=message
    )
    ready = conditions(build_status(observe(deployment=view), {}, NOW))["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "PodCreationFailed", message)
    assert ready["reason"] in FAILURE_REASONS
    raw = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "conditions": [
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}
            ]
        },
    }
    assert deployment_view(raw).replica_failure == message


def test_blocking_errors_and_fixed_replicas() -> None:
    status = build_status(observe(blocking_error=("InvalidModelURI", "spec.model.uri 'x': bad")), {}, NOW)
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "InvalidModelURI",
        "spec.model.uri 'x': bad",
    )
    fixed = build_status(observe(autoscaling=False), {}, NOW)
    assert conditions(fixed)["ScalingActive"]["reason"] == "AutoscalingDisabled"
    assert "autoscaler" not in fixed
    zero = build_status(
        observe(autoscaling=False, desired_replicas=0, deployment=deployment(replicas=0)), {}, NOW
    )
    assert conditions(zero)["Ready"]["reason"] == "ScaledToZero"


def test_views_from_raw_objects() -> None:
    pod = pod_view(
        {
            "metadata": {"name": "svc-1", "deletionTimestamp": "2025-01-01T00:00:00Z"},
            "status": {
                "phase": "Running",
                "podIP": "127.1.0.4",
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "PodScheduled", "status": "True"},
                ],
                "containerStatuses": [{"name": "runtime", "state": {"running": {}}}],
            },
        }
    )
    assert (pod.ip, pod.ready, pod.terminating, pod.scrapeable) == ("127.1.0.4", True, True, False)
    pending = pod_view(
        {
            "metadata": {"name": "svc-2"},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": GPU_MESSAGE,
                    }
                ],
            },
        }
    )
    assert pending.unschedulable_message == GPU_MESSAGE and pending.ip is None and not pending.scrapeable
    pulling = pod_view(
        {
            "metadata": {"name": "svc-3"},
            "status": {
                "initContainerStatuses": [
                    {
                        "name": "model-download",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "nope"}},
                    }
                ]
            },
        }
    )
    assert pulling.failure_reason == "ImagePullBackOff" and "model-download" in (
        pulling.failure_message or ""
    )
    view = deployment_view(
        {
            "metadata": {"generation": 4},
            "spec": {"replicas": 3},
            "status": {
                "observedGeneration": 4,
                "replicas": 3,
                "updatedReplicas": 3,
                "readyReplicas": 2,
                "availableReplicas": 2,
                "conditions": [{"type": "Progressing", "reason": "NewReplicaSetAvailable", "message": "ok"}],
            },
        }
    )
    assert view == DeploymentView(4, 4, 3, 3, 3, 2, 2, False, "ok")


def test_a_fleet_the_autoscaler_scaled_to_zero_stays_ready() -> None:
    status = build_status(
        observe(autoscaling=True, desired_replicas=0, deployment=deployment(replicas=0)), {}, NOW
    )
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    suspended = build_status(
        observe(autoscaling=False, desired_replicas=0, deployment=deployment(replicas=0)), {}, NOW
    )
    assert conditions(suspended)["Ready"]["status"] == "False", "spec.scaling.replicas: 0 is a suspension"


def test_groups_report_their_ranks_and_roll_up_in_a_condition() -> None:
    groups = [GroupStatus("svc-0", 4, 4), GroupStatus("svc-1", 4, 1)]
    status = build_status(observe(groups=groups), {}, NOW)
    assert status["groups"] == [
        {"name": "svc-0", "ranks": 4, "ranksReady": 4},
        {"name": "svc-1", "ranks": 4, "ranksReady": 1},
    ]
    grouped = conditions(status)["GroupsReady"]
    assert (grouped["status"], grouped["reason"], grouped["message"]) == (
        "False",
        "RanksStarting",
        "svc-1: 1 of 4 ranks ready",
    )
    whole = build_status(observe(groups=[GroupStatus("svc-0", 4, 4)]), {}, NOW)
    assert conditions(whole)["GroupsReady"]["status"] == "True"
    single = build_status(observe(), {}, NOW)
    assert "groups" not in single and "GroupsReady" not in conditions(single)


def test_a_group_statefulset_is_read_with_its_revision() -> None:
    view = stateful_set_view(
        {
            "metadata": {
                "name": "svc-1",
                "generation": 3,
                "labels": {"kvfleet.dev/group": "1"},
                "ownerReferences": [{"uid": "u", "controller": True}],
            },
            "spec": {"replicas": 2},
            "status": {
                "observedGeneration": 3,
                "readyReplicas": 2,
                "updatedReplicas": 1,
                "updateRevision": "r2",
            },
        }
    )
    assert view == StatefulSetView("svc-1", 1, 3, 3, 2, 2, 1, "r2", owner_uid="u")
    assert not view.rolled_out, "one pod still runs the old template"


def role_pod(role: str, name: str, ready: bool = True, **changes: Any) -> PodView:
    return PodView(f"svc-{role}-{name}", "10.0.1.1", ready, False, role=role, **changes)


def roles(
    prefill: DeploymentView | None = None,
    decode: DeploymentView | None = None,
    prefill_desired: int = 1,
    decode_desired: int = 2,
    **changes: Any,
) -> Observation:
    """A disaggregated service with a ready prefill replica and two ready decode replicas unless told."""
    prefill = prefill or deployment(
        replicas=1, status_replicas=1, updated_replicas=1, ready_replicas=1, available_replicas=1
    )
    decode = decode or deployment()
    sample = MetricsSample(time=1.0, queue_depth=3.0, reporting_pods=1, queued_prompt_tokens=1234.0)
    observations = [
        RoleObservation("prefill", True, prefill_desired, prefill, latest_sample=sample),
        RoleObservation("decode", True, decode_desired, decode, latest_sample=sample, panic=True),
    ]
    pods = [role_pod("prefill", "a"), role_pod("decode", "a"), role_pod("decode", "b")]
    return observe(deployment=None, desired_replicas=0, pods=pods, roles=observations, **changes)


def test_a_disaggregated_service_reports_each_role_and_their_sums() -> None:
    status = build_status(roles(), {}, NOW)
    assert (status["desiredReplicas"], status["replicas"], status["readyReplicas"]) == (3, 3, 3)
    assert status["roles"]["prefill"] == {
        "desiredReplicas": 1,
        "replicas": 1,
        "readyReplicas": 1,
        "autoscaler": {"queueDepth": 3.0, "queuedPromptTokens": 1234.0, "reportingPods": 1, "panic": False},
    }
    assert status["roles"]["decode"]["autoscaler"]["panic"] is True
    assert "autoscaler" not in status, "each role's figures are the role's"
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Available")
    assert ready["message"] == "prefill: 1 of 1 replicas ready; decode: 2 of 2 replicas ready"
    scaling = conditions(status)["ScalingActive"]
    assert scaling["message"] == "prefill: 1 replica(s) reporting; decode: 1 replica(s) reporting, panic mode"


def test_ready_needs_both_roles_and_a_failed_role_speaks_first() -> None:
    starting = deployment(ready_replicas=0, available_replicas=0)
    decode_starting = build_status(roles(decode=starting), {}, NOW)
    ready = conditions(decode_starting)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasStarting")
    assert ready["message"].startswith("decode: 0 of 2 replicas ready")
    prefill_pending = deployment(
        replicas=1, status_replicas=1, updated_replicas=1, ready_replicas=0, available_replicas=0
    )
    unplaced = role_pod("prefill", "a", ready=False, unschedulable_message=GPU_MESSAGE)
    observation = roles(prefill=prefill_pending, decode=starting)
    observation = replace(observation, pods=[unplaced, role_pod("decode", "a", ready=False)])
    both = build_status(observation, {}, NOW)
    ready = conditions(both)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InsufficientGPU"), "a failure over a wait"
    assert ready["message"].startswith("prefill: 1 replica(s) pending")
    assert ready["reason"] in FAILURE_REASONS


def test_a_prefill_role_at_zero_leaves_the_service_ready() -> None:
    at_zero = deployment(
        replicas=0, status_replicas=0, updated_replicas=0, ready_replicas=0, available_replicas=0
    )
    status = build_status(roles(prefill=at_zero, prefill_desired=0), {}, NOW)
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Available")
    assert ready["message"].startswith("prefill: at zero: the decode replicas compute prompts")
    # The decode role at zero while idle: the whole service is, and says so.
    idle = build_status(roles(prefill=at_zero, decode=at_zero, prefill_desired=0, decode_desired=0), {}, NOW)
    assert (conditions(idle)["Ready"]["status"], conditions(idle)["Ready"]["reason"]) == (
        "True",
        "ScaledToZero",
    )


def test_roles_without_autoscaling_or_metrics_say_so() -> None:
    fixed = roles()
    assert fixed.roles is not None
    fixed = replace(fixed, roles=[replace(role, autoscaling=False) for role in fixed.roles])
    scaling = conditions(build_status(fixed, {}, NOW))["ScalingActive"]
    assert (scaling["status"], scaling["reason"]) == ("False", "AutoscalingDisabled")
    silent = roles()
    assert silent.roles is not None
    silent = replace(silent, roles=[silent.roles[0], replace(silent.roles[1], latest_sample=None)])
    scaling = conditions(build_status(silent, {}, NOW))["ScalingActive"]
    assert (scaling["status"], scaling["reason"]) == ("False", "MetricsUnavailable")
    assert scaling["message"] == "no ready replica has reported metrics for the decode role"


def test_role_labels_are_read_from_pods_and_deployments() -> None:
    labels = {"kvfleet.dev/inference-service": "svc", ROLE_LABEL: "prefill"}
    pod = pod_view({"metadata": {"name": "p", "labels": labels}, "status": {}})
    assert pod.role == "prefill"
    view = deployment_view({"metadata": {"name": "svc-prefill", "labels": labels}, "spec": {}, "status": {}})
    assert view.role == "prefill"
    assert deployment_view({"metadata": {"name": "svc"}, "spec": {}, "status": {}}).role is None


def test_a_latency_target_no_replica_meets_is_a_condition_without_live_figures() -> None:
    status = build_status(observe(unreachable="time to first token"), {}, NOW)
    scaling = conditions(status)["ScalingActive"]
    assert (scaling["status"], scaling["reason"]) == ("True", "TargetUnreachable")
    assert scaling["message"].startswith("the time to first token target is below the replicas'")
    assert not any(character.isdigit() for character in scaling["message"])
    roles = [
        RoleObservation("prefill", True, 1, deployment(), latest_sample=observe().latest_sample),
        RoleObservation(
            "decode",
            True,
            1,
            deployment(),
            latest_sample=observe().latest_sample,
            unreachable="inter-token latency",
        ),
    ]
    split = conditions(build_status(observe(roles=roles), {}, NOW))["ScalingActive"]
    assert split["reason"] == "TargetUnreachable" and split["message"].startswith("decode: the inter-token")
