"""Status: conditions from observed pods and Deployments, and their transition times."""

from __future__ import annotations

import datetime
from dataclasses import replace
from typing import Any

from kvfleet.operator.autoscaler import MetricsSample
from kvfleet.operator.observed import (
    DeploymentView,
    PodView,
    StatefulSetView,
    deployment_view,
    pod_view,
    stateful_set_view,
)
from kvfleet.operator.status import FAILURE_REASONS, GroupStatus, Observation, build_status

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
