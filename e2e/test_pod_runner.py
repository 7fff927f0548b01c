"""The pod runner: real processes for kvfleet pods, with honest readiness, restarts and graceful deletion.

The pods here run support/probe_target.py (as the image's `probe-target` command), a server whose
readiness, crashes and drain the tests steer, so each kubelet behaviour is checked on its own.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
import urllib.request
from typing import Any

from e2e.cluster import ApiError, LocalCluster
from e2e.cluster.kube_api import KubeAPI
from e2e.cluster.processes import process_start_ticks
from e2e.support.waits import condition, wait_for

IMAGE = "registry.example/kvfleet:e2e"
PORT = 8000


def target_pod(name: str, *args: str, **spec: Any) -> dict:
    container = {
        "name": "server",
        "image": IMAGE,
        "command": ["probe-target"],
        "args": ["serve", "--host", "0.0.0.0", "--port", str(PORT), *args],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 1,
        },
    }
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 10, **spec},
    }


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def is_ready(pod: dict) -> bool:
    ready = condition(pod, "Ready")
    return ready is not None and ready["status"] == "True"


def config_error(api: KubeAPI, namespace: str, name: str) -> dict | None:
    """The pod's first container's waiting state while it is a CreateContainerConfigError, else None."""
    statuses = api.get(pod_path(namespace, name))["status"].get("containerStatuses", [])
    waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
    return waiting if waiting.get("reason") == "CreateContainerConfigError" else None


def ready_pod(cluster: LocalCluster, namespace: str, name: str) -> dict:
    """The pod once it is Ready; on a timeout the failure shows its container statuses and log."""
    path = pod_path(namespace, name)
    try:
        return wait_for("Ready", lambda: (p := cluster.api.get(path)) and is_ready(p) and p)
    except AssertionError as error:
        statuses = cluster.api.get(path)["status"].get("containerStatuses")
        log = cluster.pod_runner.log_path(namespace, name, "server")
        tail = log.read_text()[-2000:] if log.exists() else "(no log)"
        raise AssertionError(f"{error}; container statuses: {statuses}; log: {tail}") from None


def http_json(url: str, method: str = "GET") -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as response:
        return json.loads(response.read())


def process_info(pod_ip: str) -> dict:
    """What the pod's process reports about itself, once it listens."""

    def info() -> dict | None:
        try:
            return http_json(f"http://{pod_ip}:{PORT}/info")
        except OSError:
            return None

    return wait_for(f"the process to listen on {pod_ip}:{PORT}", info)


def test_pod_becomes_ready_only_when_its_process_is(local_cluster: LocalCluster, namespace: str) -> None:
    api = local_cluster.api
    api.create(f"/api/v1/namespaces/{namespace}/pods", target_pod("slow-start", "--ready-after", "3"))

    running = wait_for(
        "the process to start on the pod IP",
        lambda: (p := api.get(pod_path(namespace, "slow-start")))["status"].get("phase") == "Running" and p,
    )
    pod_ip = running["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(local_cluster.pod_cidr)
    info = process_info(pod_ip)  # it listens on the pod's IP: --host was rewritten
    assert info["argv"][info["argv"].index("--host") + 1] == pod_ip
    assert not is_ready(api.get(pod_path(namespace, "slow-start"))), "Ready before the process said so"

    started = time.monotonic()
    ready = ready_pod(local_cluster, namespace, "slow-start")
    assert time.monotonic() - started < 10
    status = ready["status"]["containerStatuses"][0]
    assert status["ready"] is True and "running" in status["state"]

    # Readiness follows the process both ways.
    http_json(f"http://{pod_ip}:{PORT}/unready", method="POST")
    wait_for(
        "Ready=False after /ready fails", lambda: not is_ready(api.get(pod_path(namespace, "slow-start")))
    )
    http_json(f"http://{pod_ip}:{PORT}/ready", method="POST")
    wait_for("Ready again", lambda: is_ready(api.get(pod_path(namespace, "slow-start"))))


def test_deleting_a_pod_drains_and_stops_its_process(local_cluster: LocalCluster, namespace: str) -> None:
    api = local_cluster.api
    api.create(f"/api/v1/namespaces/{namespace}/pods", target_pod("drains", "--drain-seconds", "2"))
    pod = ready_pod(local_cluster, namespace, "drains")
    pid = process_info(pod["status"]["podIP"])["pid"]
    assert process_start_ticks(pid) is not None

    deleted_at = time.monotonic()
    api.delete(pod_path(namespace, "drains"))
    # While the process drains, the pod still exists (Terminating) and readiness reports the drain.
    terminating = api.get(pod_path(namespace, "drains"))
    assert terminating["metadata"].get("deletionTimestamp")
    wait_for("Ready=False while draining", lambda: not is_ready(api.get(pod_path(namespace, "drains"))))

    def gone() -> bool:
        try:
            api.get(pod_path(namespace, "drains"))
            return False
        except ApiError as error:
            return error.status == 404

    wait_for("the pod to be removed", gone, timeout=30)
    assert time.monotonic() - deleted_at >= 1.5, "removed before its process finished draining"
    assert process_start_ticks(pid) is None, "the process outlived its pod"
    log = local_cluster.pod_runner.log_path(namespace, "drains", "server").read_text()
    assert "got signal 15, draining" in log and "drained, exiting" in log


def test_crashing_container_is_restarted_with_backoff(local_cluster: LocalCluster, namespace: str) -> None:
    api = local_cluster.api
    api.create(
        f"/api/v1/namespaces/{namespace}/pods",
        target_pod("crashes", "--exit-after", "0.5", "--exit-code", "3"),
    )

    def backing_off_after_two_restarts() -> dict | None:
        # One snapshot of the pod: between restarts the process lives 0.5 s and may be Ready for a moment.
        pod = api.get(pod_path(namespace, "crashes"))
        statuses = pod["status"].get("containerStatuses", [])
        if statuses and statuses[0]["restartCount"] >= 2 and "waiting" in statuses[0]["state"]:
            return pod
        return None

    pod = wait_for("a back-off after two restarts", backing_off_after_two_restarts, timeout=30)
    status = pod["status"]["containerStatuses"][0]
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert not status["ready"] and not is_ready(pod)
    events = api.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    assert any(e["reason"] == "BackOff" and e["involvedObject"]["name"] == "crashes" for e in events)


def test_container_gets_the_env_args_and_account_its_pod_describes(
    local_cluster: LocalCluster, namespace: str
) -> None:
    api = local_cluster.api
    api.create(
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"mode": "fast"}},
    )
    pod = target_pod(
        "env",
        "--model",
        "/models/tiny",
        "--mode=$(MODE)",
        container={
            "env": [
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "CACHE", "value": "/models/cache"},
            ],
            "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            "resources": {"limits": {"cpu": "2"}},
        },
        volumes=[{"name": "models", "emptyDir": {}}],
    )
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    ready = ready_pod(local_cluster, namespace, "env")
    pod_ip = ready["status"]["podIP"]
    info = process_info(pod_ip)
    argv, env = info["argv"], info["env"]

    assert "--mode=fast" in argv
    assert env["MODE"] == "fast" and env["POD_IP"] == pod_ip and env["POD_NAME"] == "env"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env.get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")  # the host's, on its nodes
    model_dir = argv[argv.index("--model") + 1]
    assert model_dir != "/models/tiny" and model_dir.endswith("/volumes/models/tiny")
    assert env["CACHE"] == model_dir.replace("/tiny", "/cache")

    # The process talks to the API server as the pod's ServiceAccount, with exactly its rights.
    pods = f"/api/v1/namespaces/{namespace}/pods"
    assert http_json(f"http://{pod_ip}:{PORT}/api-status{pods}")["status"] == 403


def test_unknown_command_is_reported_not_run(local_cluster: LocalCluster, namespace: str) -> None:
    api = local_cluster.api
    pod = target_pod("bad-command", container={"command": ["bash", "-c", "echo hi"]})
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)

    waiting = wait_for("CreateContainerConfigError", lambda: config_error(api, namespace, "bad-command"))
    assert "'bash' is not a command the pod runner knows" in waiting["message"]


def test_a_pod_whose_config_map_comes_later_starts_once_it_exists(
    local_cluster: LocalCluster, namespace: str
) -> None:
    api = local_cluster.api
    env = [{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "late", "key": "mode"}}}]
    api.create(f"/api/v1/namespaces/{namespace}/pods", target_pod("waits", container={"env": env}))

    waiting = wait_for("CreateContainerConfigError", lambda: config_error(api, namespace, "waits"))
    assert "ConfigMap" in waiting["message"]
    api.create(
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "late"}, "data": {"mode": "fast"}},
    )
    assert ready_pod(local_cluster, namespace, "waits")["status"]["containerStatuses"][0]["restartCount"] == 0
