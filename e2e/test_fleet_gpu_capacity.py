"""More replicas than the GPUs there are: the pods the scheduler cannot place stay Pending, the service says
Scheduled=False with reason InsufficientGPU and the scheduler's message, and the autoscaler stops asking.

The replicas' pods are kwok's (no process): demand comes from a stand-in /metrics server listening on the
running replica's pod IP, which is where the operator scrapes.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.cluster import GPU_RESOURCE, LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import RUNTIME_PORT, deployment_path, fake_gpu_service, services_path
from e2e.fleet.observe import events_for, service_pods, wait_condition, wait_ready
from e2e.support.waits import condition, wait_for

WAITING_REQUESTS = 20


class QueueMetrics(http.server.BaseHTTPRequestHandler):
    """A replica's /metrics with a deep queue, in the runtime's metric names."""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = (
            "# HELP kvfleet:num_requests_waiting Requests waiting to be scheduled.\n"
            "# TYPE kvfleet:num_requests_waiting gauge\n"
            f'kvfleet:num_requests_waiting{{model_name="capacity"}} {WAITING_REQUESTS}.0\n'
            "# HELP kvfleet:num_requests_running Requests in the running batch.\n"
            "# TYPE kvfleet:num_requests_running gauge\n"
            'kvfleet:num_requests_running{model_name="capacity"} 4.0\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def busy_replica_metrics() -> Iterator[Callable[[str], None]]:
    """A function that serves QueueMetrics on a pod IP's runtime port, until the test ends."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(ip: str) -> None:
        server = http.server.ThreadingHTTPServer((ip, RUNTIME_PORT), QueueMetrics)
        threading.Thread(target=server.serve_forever, name=f"metrics-{ip}", daemon=True).start()
        servers.append(server)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def free_gpu_node(local_cluster: LocalCluster) -> str:
    """A fake node none of whose GPUs are taken."""
    pods = local_cluster.api.get("/api/v1/pods")["items"]
    taken = {
        pod["spec"].get("nodeName")
        for pod in pods
        for container in pod["spec"]["containers"]
        if GPU_RESOURCE in container.get("resources", {}).get("limits", {})
    }
    nodes = sorted(n["metadata"]["name"] for n in local_cluster.api.get("/api/v1/nodes")["items"])
    return next(node for node in reversed(nodes) if node not in taken)


def test_replicas_beyond_the_gpus_stay_pending_and_hold_scaling(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    busy_replica_metrics: Callable[[str], None],
) -> None:
    api = local_cluster.api
    node = free_gpu_node(local_cluster)
    gpus_per_node = local_cluster.config.node_shape.gpus
    # Each replica takes a whole node and all replicas must go to that one node: only the first fits.
    manifest = fake_gpu_service(
        "capacity",
        gpus=gpus_per_node,
        resources={"nodeSelector": {"kubernetes.io/hostname": node}},
        scaling={
            "replicas": None,
            "minReplicas": 1,
            "maxReplicas": 4,
            "targetQueueDepth": 1,
            "maxScaleUpStep": 1,
            "stableWindowSeconds": 6,
            "panicWindowSeconds": 2,
            "metricsIntervalSeconds": 1,
            "scaleDownDelaySeconds": 600,
        },
    )
    api.create(services_path(namespace), manifest)
    wait_ready(api, namespace, "capacity")
    (running,) = service_pods(api, namespace, "capacity")
    busy_replica_metrics(running["status"]["podIP"])

    wait_for(
        "the autoscaler to add a replica",
        lambda: api.get(deployment_path(namespace, "capacity"))["spec"]["replicas"] >= 2,
        30,
    )
    service = wait_condition(api, namespace, "capacity", "Scheduled", "False", "InsufficientGPU", timeout=30)
    scheduled = condition(service, "Scheduled")
    assert scheduled is not None
    assert "1 replica(s) pending" in scheduled["message"]
    assert f"Insufficient {GPU_RESOURCE}" in scheduled["message"]
    pending = [
        pod for pod in service_pods(api, namespace, "capacity") if pod["status"].get("phase") == "Pending"
    ]
    assert len(pending) == 1
    pod_scheduled = condition(pending[0], "PodScheduled")
    assert pod_scheduled is not None and pod_scheduled["reason"] == "Unschedulable"

    # Demand still wants 4 (24 requests, 1 per replica), but nothing more is asked while one cannot be placed.
    held_until = time.monotonic() + 8
    while time.monotonic() < held_until:
        assert api.get(deployment_path(namespace, "capacity"))["spec"]["replicas"] == 2
        time.sleep(0.25)
    service = api.get(services_path(namespace, "capacity"))
    assert service["status"]["desiredReplicas"] == 2
    assert service["status"]["readyReplicas"] == 1
    scaled_up = [event for event in events_for(api, namespace, "capacity") if event["reason"] == "ScaledUp"]
    assert len(scaled_up) == 1 and "from 1 to 2" in scaled_up[0]["message"]
    warnings = [
        event for event in events_for(api, namespace, "capacity") if event["reason"] == "InsufficientGPU"
    ]
    assert warnings and warnings[0]["type"] == "Warning"
