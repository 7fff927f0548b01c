"""The gateway's Kubernetes discovery against the real API server: it lists and then watches
InferenceServices and EndpointSlices and publishes the fleet the gateway routes to.

The local cluster runs no EndpointSlice controller (pod IPs are loopback addresses, which the API server
refuses in EndpointSlices), so the test writes the slice a controller would write, with other addresses.
The service has `replicas: 0`, so the operator starts no runtime pod for it.
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
from e2e.fleet.manifests import inference_service, services_path

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
        make_api_client(str(cluster.kubeconfig), None, pool_size=4), [namespace], DEFAULTS
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
        loop.close()


def endpoint_slice(namespace: str, service: str, ready: dict[str, bool]) -> dict[str, object]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-manual",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "app.kubernetes.io/managed-by": "kvfleet-operator",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": is_ready}} for ip, is_ready in ready.items()
        ],
    }


def test_the_gateway_follows_services_and_their_ready_endpoints(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    api = local_cluster.api
    spec = {
        "model": {"uri": "hf://acme/model", "servedName": "alpha-model"},
        "scaling": {"replicas": 0, "activationTimeoutSeconds": 90},
        "routing": {"policy": "prefix-hash", "loadBoundPercent": 150},
        "resources": {"gpus": 0},
    }
    slices = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    api.create(services_path(namespace), inference_service("alpha", spec))
    api.create(slices, endpoint_slice(namespace, "alpha", {"10.77.0.1": True, "10.77.0.2": False}))
    with discovering(local_cluster, namespace) as published:
        models = published.wait_for("alpha-model with its ready endpoint", lambda m: "alpha-model" in m)
        alpha = models["alpha-model"]
        assert alpha.endpoints == ("http://10.77.0.1:8000",)
        assert (alpha.policy, alpha.load_bound, alpha.hold_seconds) == ("prefix-hash", 1.5, 90.0)
        # Changes arrive through the watch.
        api.patch(
            f"{slices}/alpha-manual",
            {
                "endpoints": [
                    {"addresses": [ip], "conditions": {"ready": True}} for ip in ("10.77.0.1", "10.77.0.2")
                ]
            },
            content_type=MERGE_PATCH,
        )
        published.wait_for(
            "both endpoints", lambda m: m.get("alpha-model") and len(m["alpha-model"].endpoints) == 2
        )
        beta = {**spec, "model": {"uri": "hf://acme/other"}, "routing": {}}
        api.create(services_path(namespace), inference_service("beta", beta))
        models = published.wait_for("beta at zero", lambda m: "beta" in m)
        assert models["beta"].endpoints == () and models["beta"].policy == "least-request"
        api.delete(services_path(namespace, "alpha"))
        published.wait_for("alpha gone", lambda m: "alpha-model" not in m and "beta" in m)
