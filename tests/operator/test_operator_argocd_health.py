"""The Argo CD health check (Lua), run by a Lua interpreter on sample objects and on statuses the
operator itself builds."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import lupa
import pytest
from kvfleet.operator.observed import DeploymentView, PodView
from kvfleet.operator.status import FAILURE_REASONS, SCALED_TO_ZERO, GroupStatus, Observation, build_status

LUA = (Path(__file__).resolve().parents[2] / "charts" / "kvfleet" / "files" / "argocd-health.lua").read_text()
NOW = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


def health(obj: dict[str, Any]) -> dict[str, str]:
    runtime = lupa.LuaRuntime()
    # Argo CD runs the script with the live object as the global `obj`.
    runtime.globals().obj = runtime.table_from(obj, recursive=True)
    return dict(runtime.execute(LUA))


def service(generation: int = 2, status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "svc", "generation": generation}, "spec": {}}
    if status is not None:
        obj["status"] = status
    return obj


def ready(status: str, reason: str, generation: int = 2, message: str = "m") -> dict[str, Any]:
    condition = {"type": "Ready", "status": status, "reason": reason, "message": message}
    return {"observedGeneration": generation, "conditions": [condition | {"observedGeneration": generation}]}


def test_new_object_is_progressing() -> None:
    assert health(service(status=None))["status"] == "Progressing"
    assert health(service(status={}))["status"] == "Progressing"


def test_stale_generation_is_progressing() -> None:
    result = health(service(generation=3, status=ready("True", "Available", generation=2)))
    assert result == {
        "status": "Progressing",
        "message": "Waiting for the kvfleet operator to observe generation 3",
    }
    stale_condition = ready("True", "Available")
    stale_condition["conditions"][0]["observedGeneration"] = 1
    assert health(service(status=stale_condition))["status"] == "Progressing"


def test_healthy_suspended_progressing() -> None:
    assert health(service(status=ready("True", "Available", message="2 of 2 replicas ready"))) == {
        "status": "Healthy",
        "message": "2 of 2 replicas ready",
    }
    assert health(service(status=ready("False", SCALED_TO_ZERO)))["status"] == "Suspended"
    for reason in ("RollingOut", "ReplicasStarting", "DeploymentPending"):
        assert health(service(status=ready("False", reason)))["status"] == "Progressing"


@pytest.mark.parametrize("reason", sorted(FAILURE_REASONS))
def test_every_failure_reason_is_degraded(reason: str) -> None:
    result = health(service(status=ready("False", reason, message="what went wrong")))
    assert result == {"status": "Degraded", "message": "what went wrong"}


def observation(**changes: Any) -> Observation:
    base: dict[str, Any] = {
        "generation": 2,
        "url": "http://svc.ns.svc.cluster.local",
        "selector": "kvfleet.dev/inference-service=svc",
        "autoscaling": True,
        "desired_replicas": 2,
        "deployment": DeploymentView(5, 5, 2, 2, 2, 2, 2),
        "pods": [],
        "gpu_resource_name": "nvidia.com/gpu",
    }
    return Observation(**(base | changes))


def test_statuses_the_operator_writes() -> None:
    pending = PodView(
        "p", None, False, False, unschedulable_message="0/4 nodes: 4 Insufficient nvidia.com/gpu"
    )
    cases = {
        "Healthy": observation(),
        "Progressing": observation(deployment=DeploymentView(5, 5, 2, 3, 1, 2, 2)),
        "Degraded": observation(deployment=DeploymentView(5, 5, 2, 2, 2, 0, 0), pods=[pending]),
        "Suspended": observation(autoscaling=False, desired_replicas=0),
    }
    for expected, case in cases.items():
        status = build_status(case, {}, NOW)
        assert health(service(status=status))["status"] == expected, status["conditions"][0]
    invalid = build_status(observation(blocking_error=("InvalidModelURI", "bad uri")), {}, NOW)
    assert health(service(status=invalid)) == {"status": "Degraded", "message": "bad uri"}


def test_a_service_of_groups_is_healthy_only_with_a_whole_group() -> None:
    groups = [GroupStatus("svc-0", 2, 2), GroupStatus("svc-1", 2, 1)]
    crashing = PodView(
        "svc-0-1", "10.0.0.2", False, False, failure_reason="CrashLoopBackOff", failure_message="rank 1 exits"
    )
    cases = {
        # One group whole: it serves while the other's ranks come up.
        "Healthy": observation(deployment=DeploymentView(1, 1, 2, 2, 2, 1, 1), groups=groups),
        "Progressing": observation(deployment=DeploymentView(1, 1, 2, 2, 2, 0, 0), groups=groups),
        "Degraded": observation(
            deployment=DeploymentView(1, 1, 2, 2, 2, 0, 0), groups=groups, pods=[crashing]
        ),
    }
    for expected, case in cases.items():
        status = build_status(case, {}, NOW)
        assert health(service(status=status))["status"] == expected, status["conditions"][0]
