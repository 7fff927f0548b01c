"""vLLM itself under kvfleet's operator and gateway: an InferenceService with `runtime: vllm` runs
`vllm serve` (vLLM's CPU build) in its pods, answers a chat completion through the gateway with the openai
SDK, and a burst sent through the gateway fills vLLM's own waiting queue, on which the operator adds a
replica that the gateway then sends requests to. What only kvfleet's runtime does, the API server refuses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import ApiError, LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.gateway import metric
from e2e.fleet.manifests import inference_service, services_path
from e2e.fleet.observe import ReplicaHistory, events_for, service_pods, wait_ready
from e2e.fleet.traffic import ChatLoad, Endpoint, ReadyEndpoints, chat, serving_endpoints
from e2e.support.waits import wait_for

NAMESPACE = "vllm-runtime"
NAME = "small-vllm"
MODEL = f"{NAMESPACE}/small"
SCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    # vLLM runs two sequences at a time; 8 clients leave about 6 waiting, which want more than 2 replicas.
    "targetQueueDepth": 2,
    "stableWindowSeconds": 6,
    "panicWindowSeconds": 2,
    "scaleDownDelaySeconds": 600,
    "metricsIntervalSeconds": 1,
    "maxScaleUpStep": 1,
}
CLIENTS = 8
# vLLM loads in about a minute on 2 busy cores (eager mode: no compilation).
READY_SECONDS = 300.0


def vllm_service(model_dir: Path) -> dict[str, Any]:
    spec = {
        "model": {"uri": f"file://{model_dir}", "servedName": "small", "hostPath": True},
        "engine": {
            "runtime": "vllm",
            "dtype": "float32",
            "maxModelLen": 512,
            "drainTimeoutSeconds": 5,
            "startupTimeoutSeconds": 600,
            "env": [
                {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                {"name": "OMP_NUM_THREADS", "value": "1"},
                # The pods share this machine's cores: vLLM would pin each replica's threads to the same one.
                {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
            ],
            # vLLM's own flags. Its batch is capped here rather than in engine.maxNumSeqs, which would also
            # cap what the gateway sends a replica: the requests past two then wait in vLLM's queue.
            "extraArgs": ["--max-num-seqs", "2", "--enforce-eager"],
        },
        "resources": {"gpus": 0, "cpu": "1", "memory": "3Gi"},
        "scaling": SCALING,
        "sla": {"tier": "standard"},
    }
    return inference_service(NAME, spec)


def replica(pod: dict[str, Any]) -> Endpoint:
    return Endpoint(pod["metadata"]["name"], pod["status"]["podIP"])


@pytest.fixture(scope="module")
def service(cluster: LocalCluster, release: OperatorRelease, small_model_dir: Path) -> Iterator[str]:
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.api.create(services_path(NAMESPACE), vllm_service(small_model_dir))
    wait_ready(cluster.api, NAMESPACE, NAME, timeout=READY_SECONDS)
    yield NAME
    cluster.api.delete(services_path(NAMESPACE, NAME))


def test_the_api_server_refuses_what_only_kvfleets_runtime_does(
    cluster: LocalCluster, release: OperatorRelease, small_model_dir: Path
) -> None:
    manifest = vllm_service(small_model_dir)
    manifest["metadata"]["name"] = "vllm-with-batch"
    manifest["spec"] |= {"batch": {"storage": "EmptyDir"}, "scaling": {"replicas": 1}}
    with pytest.raises(ApiError) as refused:
        cluster.api.create(services_path("default"), manifest)
    assert refused.value.status == 422
    assert "batch is not served with engine.runtime vllm" in str(refused.value)


@pytest.mark.timeout(1200)
def test_a_vllm_service_answers_a_chat_completion_through_the_gateway(
    cluster: LocalCluster, service: str, gateway: ReadyEndpoints
) -> None:
    (pod,) = service_pods(cluster.api, NAMESPACE, service)
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["vllm", "serve"]
    answered_before = metric(replica(pod), "vllm:request_success_total{")

    answer = chat(gateway.current()[0], "Say hello.", max_tokens=8, model=MODEL)

    assert answer
    assert metric(replica(pod), "vllm:request_success_total{") == answered_before + 1, "vLLM answered it"


@pytest.mark.timeout(900)
def test_a_burst_fills_vllms_queue_and_the_operator_adds_a_replica_the_gateway_uses(
    cluster: LocalCluster,
    service: str,
    gateway: ReadyEndpoints,
) -> None:
    api = cluster.api
    (first,) = service_pods(api, NAMESPACE, service)
    with (
        ReplicaHistory(api, NAMESPACE, service) as history,
        ChatLoad(gateway, CLIENTS, max_tokens=192, model=MODEL) as load,
    ):
        burst_began = time.monotonic()
        wait_for(
            "requests waiting in vLLM's queue",
            lambda: metric(replica(first), "vllm:num_requests_waiting{") >= 2,
            60,
            interval=0.5,
        )
        decided = wait_for("a scale-up", lambda: history.first(lambda s: s.desired >= 2), 60)
        ready = wait_for(
            "the new replica Ready", lambda: history.first(lambda s: s.ready >= 2), READY_SECONDS
        )
        (second,) = [
            endpoint
            for endpoint in serving_endpoints(service_pods(api, NAMESPACE, service))
            if endpoint.pod != first["metadata"]["name"]
        ]
        wait_for(
            "the gateway's requests answered by the new replica",
            lambda: metric(second, "vllm:request_success_total{") > 0,
            60,
            interval=0.5,
        )
    print(
        f"replicas 1 -> 2 decided {decided.at - burst_began:.1f}s after the burst began, the new vLLM "
        f"replica Ready after {ready.at - burst_began:.1f}s; {len(load.successes())} requests answered"
    )
    assert not load.failures(), load.failures()[:3]
    reasons = [event["reason"] for event in events_for(api, NAMESPACE, service)]
    assert "ScaledUp" in reasons, reasons
    assert "queue depth" in api.get(services_path(NAMESPACE, service))["status"]["lastScaleReason"]
