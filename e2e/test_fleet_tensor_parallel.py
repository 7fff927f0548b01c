"""A model split over two nodes, served for real: tensor parallel 2 with one GPU per node makes a group of two
`kvfleet serve` pods (a StatefulSet, one fake GPU node each) that meet at rank 0's name under the headless
Service, load their shards, become Ready and answer chat completions through the openai SDK by the clients'
Service. Rank 1's pod deleted, rank 0 leaves the broken group, the pod runner restarts it, the StatefulSet
recreates rank 1, and the group answers again.

The GPUs are the fake nodes' (a resource the scheduler counts): the ranks run on the CPU with gloo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from dnslib import QTYPE, DNSRecord

from e2e.cluster import GPU_RESOURCE, LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import RUNTIME_PORT, one_node_per_pod, services_path, statefulset_path, tiny_service
from e2e.fleet.observe import groups_whole, live_pods, wait_ready
from e2e.fleet.traffic import Endpoint, chat
from e2e.support.waits import wait_for

NAME = "tp"
# Joining the group, loading two shards and the engine core's start, on 2 shared cores.
START_TIMEOUT = 300.0


def resolve(local_cluster: LocalCluster, name: str) -> list[str]:
    """The A records the cluster's DNS server gives for name, as a pod's resolver would ask."""
    assert local_cluster.network is not None
    answer = DNSRecord.question(name).send(local_cluster.network.dns_address, 53, timeout=5)
    return sorted(str(record.rdata) for record in DNSRecord.parse(answer).rr if record.rtype == QTYPE.A)


def clients_service(local_cluster: LocalCluster, namespace: str) -> Callable[[], Endpoint | None]:
    """The clients' Service as its proxy serves it: its address once it has a ready endpoint."""
    assert local_cluster.network is not None
    services = local_cluster.network.services

    def endpoint() -> Endpoint | None:
        service = services.get(namespace, NAME)
        if service is None or service.address is None or not service.endpoints:
            return None
        (port,) = service.ports
        return Endpoint(f"service {NAME} -> {service.endpoints[0].pod}", service.address, port.port)

    return endpoint


def rank_pods(api: Any, namespace: str) -> dict[str, dict[str, Any]]:
    return {pod["metadata"]["name"]: pod for pod in live_pods(api, namespace, NAME)}


def restarts(pod: dict[str, Any]) -> int:
    (status,) = pod["status"].get("containerStatuses", [{"restartCount": 0}])
    return int(status["restartCount"])


def test_tensor_parallel_over_two_nodes_serves_and_recovers_a_lost_rank(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    manifest = tiny_service(
        NAME,
        tiny_model_dir,
        # The nodes' GPUs are fake: the ranks run on the CPU, whatever the machine running the test has.
        engine={"tensorParallelSize": 2, "extraArgs": ["--cpu-kv-cache-space", "0.0625", "--device", "cpu"]},
        resources={"gpus": 1, "gpusPerNode": 1, "affinity": one_node_per_pod(NAME)},
    )
    started = time.monotonic()
    api.create(services_path(namespace), manifest)
    wait_ready(api, namespace, NAME, timeout=START_TIMEOUT)
    wait_for("both ranks ready", lambda: groups_whole(api, namespace, NAME), 60)
    measurements(f"tensor parallel 2 over two nodes: Ready {time.monotonic() - started:.1f}s after creation")

    assert api.get(statefulset_path(namespace, f"{NAME}-0"))["spec"]["replicas"] == 2
    pods = rank_pods(api, namespace)
    assert sorted(pods) == [f"{NAME}-0-0", f"{NAME}-0-1"]
    rank0, rank1 = pods[f"{NAME}-0-0"], pods[f"{NAME}-0-1"]
    assert rank0["spec"]["nodeName"] != rank1["spec"]["nodeName"], "one node per rank"
    for pod in pods.values():
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"][GPU_RESOURCE] == "1"
    # Rank 1 found rank 0 by its stable name, which the cluster's DNS gives as rank 0's pod IP.
    master = f"{NAME}-0-0.{NAME}-ranks.{namespace}.svc.cluster.local"
    args = rank1["spec"]["containers"][0]["args"]
    assert args[args.index("--master-addr") + 1] == master
    assert resolve(local_cluster, master) == [rank0["status"]["podIP"]]

    routed = clients_service(local_cluster, namespace)
    service = wait_for("the clients' Service to route to rank 0", routed, 30)
    assert service.pod == f"service {NAME} -> {NAME}-0-0"
    assert chat(service, "Say something about tensors.", max_tokens=12)
    # Rank 1 serves no API, only its /health.
    rank1_url = f"http://{rank1['status']['podIP']}:{RUNTIME_PORT}"
    assert httpx.get(f"{rank1_url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{rank1_url}/v1/models", timeout=5).status_code == 404

    lost_at = time.monotonic()
    api.delete(f"/api/v1/namespaces/{namespace}/pods/{NAME}-0-1")

    def replaced() -> dict[str, Any] | None:
        again = rank_pods(api, namespace).get(f"{NAME}-0-1")
        return again if again is not None and again["metadata"]["uid"] != rank1["metadata"]["uid"] else None

    wait_for("rank 1's pod recreated", replaced, 120)
    # Rank 0's workers lost their peer: its container exits and restarts, so the group meets again whole.
    wait_for(
        "rank 0's container restarted",
        lambda: restarts(rank_pods(api, namespace)[f"{NAME}-0-0"]) > restarts(rank0) or None,
        120,
    )
    wait_for("the group whole again", lambda: groups_whole(api, namespace, NAME), START_TIMEOUT)
    assert rank_pods(api, namespace)[f"{NAME}-0-0"]["metadata"]["uid"] == rank0["metadata"]["uid"]
    service = wait_for("the clients' Service to route again", routed, 30)
    assert chat(service, "Say something about recovery.", max_tokens=12)
    recovered = time.monotonic() - lost_at
    measurements(f"tensor parallel 2: answering again {recovered:.1f}s after rank 1's pod was deleted")
