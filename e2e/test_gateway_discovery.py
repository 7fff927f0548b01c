"""The gateway's Kubernetes discovery against the real API server: it lists and then watches
InferenceServices and their replicas' pods and publishes the fleet the gateway routes to.

The pods are the operator's own, on kwok's fake GPU nodes (kwok marks them Running and Ready with an IP; no
process runs), so the test follows a fleet scaling without starting a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.kube import KubernetesDiscovery
from kvfleet.operator.kube_client import make_api_client

from e2e.cluster import LocalCluster
from e2e.cluster.kube_api import MERGE_PATCH
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import fake_gpu_service, services_path
from e2e.fleet.observe import service_pods
from e2e.support.waits import condition

DEFAULTS = ModelConfig(name="", endpoints=(), policy="least-request", hold_seconds=30)
WAIT_SECONDS = 60.0


class Published:
    """What the discovery published last, shared between its event loop's thread and the test."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelConfig] | None = None

    def __call__(self, models: Mapping[str, ModelConfig]) -> None:
        with self._lock:
            self._models = dict(models)

    def wait_for(
        self, what: str, condition: Callable[[dict[str, ModelConfig]], bool]
    ) -> dict[str, ModelConfig]:
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:
            with self._lock:
                models = self._models
            if models is not None and condition(models):
                return models
            time.sleep(0.05)
        raise AssertionError(f"never published {what}; last: {self._models}")


@contextmanager
def discovering(cluster: LocalCluster, namespace: str) -> Iterator[Published]:
    published = Published()
    discovery = KubernetesDiscovery(
        make_api_client(str(cluster.kubeconfig), None, pool_size=1).configuration, [namespace], DEFAULTS
    )
    loop = asyncio.new_event_loop()
    task = loop.create_task(discovery.run(published))

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # how the test stops it
            loop.run_until_complete(task)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield published
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=10)
        stopped = not thread.is_alive()
        if stopped:
            loop.close()
    # Reached only when the test passed; a failure above propagates as it is.
    assert stopped, "the discovery was cancelled but still runs 10 s later"


def test_the_gateway_follows_services_and_their_ready_pods(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    api = local_cluster.api
    alpha = fake_gpu_service(
        "alpha",
        model={"uri": "hf://acme/model", "servedName": "alpha-model"},
        scaling={"replicas": 2, "activationTimeoutSeconds": 90},
        routing={"policy": "prefix-hash", "loadBoundPercent": 150},
    )
    api.create(services_path(namespace), alpha)
    alpha_model, beta_model = f"{namespace}/alpha-model", f"{namespace}/beta"
    with discovering(local_cluster, namespace) as published:
        models = published.wait_for(
            "alpha-model with its 2 ready replicas",
            lambda m: alpha_model in m and len(m[alpha_model].endpoints) == 2,
        )
        model = models[alpha_model]
        ips = sorted(
            pod["status"]["podIP"] for pod in service_pods(api, namespace, "alpha") if is_pod_ready(pod)
        )
        assert model.endpoints == tuple(f"http://{ip}:8000" for ip in ips)
        assert (model.policy, model.load_bound, model.hold_seconds) == ("prefix-hash", 1.5, 90.0)
        # Changes arrive through the watch: a replica fewer, then another service at zero.
        api.patch(
            services_path(namespace, "alpha"),
            {"spec": {"scaling": {"replicas": 1}}},
            content_type=MERGE_PATCH,
        )
        published.wait_for("one replica", lambda m: len(m[alpha_model].endpoints) == 1)
        beta = fake_gpu_service("beta", model={"uri": "hf://acme/other"}, scaling={"replicas": 0})
        api.create(services_path(namespace), beta)
        models = published.wait_for("beta at zero", lambda m: beta_model in m)
        assert models[beta_model].endpoints == () and models[beta_model].policy == "least-request"
        api.delete(services_path(namespace, "alpha"))
        published.wait_for("alpha gone", lambda m: alpha_model not in m and beta_model in m)


def is_pod_ready(pod: dict[str, object]) -> bool:
    ready = condition(pod, "Ready")
    return ready is not None and ready["status"] == "True"
