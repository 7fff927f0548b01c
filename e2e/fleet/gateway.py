"""The chart's fleet gateway on a local cluster: turned on and off in a release, its pods' endpoints, and its
metrics as the tests read them."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from e2e.cluster import LocalCluster
from e2e.fleet.chart import CHART_DIR, ClusterAccess, OperatorRelease
from e2e.fleet.observe import wait_ready
from e2e.fleet.streams import gateway_client
from e2e.fleet.traffic import Endpoint, ReadyEndpoints
from e2e.support.waits import wait_for

GATEWAY_PORT = 8080  # the chart's gateway.port
GATEWAY_SELECTOR = "app.kubernetes.io/name=kvfleet,app.kubernetes.io/component=gateway"
GATEWAY_CONTAINER = "gateway"


def upgrade_release(
    cluster: ClusterAccess,
    release: OperatorRelease,
    *values: str,
    json_values: Mapping[str, object] | None = None,
) -> None:
    """helm upgrade of the release with these `--set` values (and `--set-json` ones: an empty list is one
    only there) over the ones it has."""
    cluster.helm(
        "upgrade",
        release.release,
        str(CHART_DIR),
        "--namespace",
        release.namespace,
        "--reuse-values",
        *(f"--set={value}" for value in values),
        *(f"--set-json={key}={json.dumps(value)}" for key, value in (json_values or {}).items()),
        "--wait",
        "--timeout=180s",
    )


def gateway_endpoints(cluster: ClusterAccess, namespace: str) -> ReadyEndpoints:
    """The ready gateway pods of the release in `namespace`, refreshed in the background once entered."""
    return ReadyEndpoints(cluster.api, namespace, "gateway", selector=GATEWAY_SELECTOR, port=GATEWAY_PORT)


@contextlib.contextmanager
def gateway_enabled(cluster: ClusterAccess, release: OperatorRelease) -> Iterator[ReadyEndpoints]:
    """The release's gateway turned on (its two replicas ready) while inside, and off again after."""
    upgrade_release(cluster, release, "gateway.enabled=true")
    try:
        with gateway_endpoints(cluster, release.namespace) as endpoints:
            wait_for("2 ready gateway replicas", lambda: len(endpoints.refresh()) == 2, 60)
            yield endpoints
    finally:
        upgrade_release(cluster, release, "gateway.enabled=false")


def metric(endpoint: Endpoint, name: str, *labels: str) -> float:
    """The sum of a metric's samples on a pod's /metrics (those with every label given: `model="ns/m"`)."""
    return metric_in(scrape(endpoint), name, *labels)


def scrape(endpoint: Endpoint) -> str:
    """A pod's /metrics, to read several metrics of one moment from."""
    with urllib.request.urlopen(f"http://{endpoint.ip}:{endpoint.port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric_in(text: str, name: str, *labels: str) -> float:
    """The sum of a metric's samples in a scraped /metrics text (those with every label given)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and all(label in line for label in labels)
    )


def serve_through_gateway(
    local_cluster: LocalCluster, gateway: ReadyEndpoints, namespace: str, manifest: dict[str, Any]
) -> str:
    """Applies the InferenceService and waits until every gateway replica lists its model; its name."""
    name, served = manifest["metadata"]["name"], manifest["spec"]["model"]["servedName"]
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
    wait_ready(local_cluster.api, namespace, name, timeout=180)
    model = f"{namespace}/{served}"
    for endpoint in gateway.current():
        with gateway_client(endpoint, timeout=30) as client:
            wait_for(
                f"{endpoint.pod} to know {model}",
                lambda client=client: model in {card.id for card in client.models.list().data},
                60,
            )
    return model
