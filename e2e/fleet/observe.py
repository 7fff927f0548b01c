"""Reading an InferenceService and its children from the API: readiness, conditions, replica history."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from e2e.cluster import ApiError, KubeAPI
from e2e.fleet.manifests import deployment_path, service_selector, services_path
from e2e.fleet.traffic import Endpoint, ReadyEndpoints
from e2e.support.polling import BackgroundPoller
from e2e.support.waits import condition, wait_for


def is_ready(service: dict[str, Any]) -> bool:
    """Ready=True for the object's current generation."""
    ready = condition(service, "Ready")
    generation = service["metadata"].get("generation")
    return (
        ready is not None
        and ready["status"] == "True"
        and service.get("status", {}).get("observedGeneration") == generation
    )


def wait_ready(api: KubeAPI, namespace: str, name: str, timeout: float = 120.0) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        service = api.get(services_path(namespace, name))
        return service if is_ready(service) else None

    return wait_for(f"InferenceService {namespace}/{name} Ready", ready, timeout=timeout, interval=0.25)


def wait_condition(
    api: KubeAPI,
    namespace: str,
    name: str,
    kind: str,
    status: str,
    reason: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Waits until the condition `kind` has that status (and reason); returns the object."""

    def matches() -> dict[str, Any] | None:
        service = api.get(services_path(namespace, name))
        found = condition(service, kind)
        if found and found["status"] == status and (reason is None or found.get("reason") == reason):
            return service
        return None

    return wait_for(
        f"{kind}={status} ({reason}) on {namespace}/{name}", matches, timeout=timeout, interval=0.25
    )


def service_pods(api: KubeAPI, namespace: str, name: str) -> list[dict[str, Any]]:
    return api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=service_selector(name))["items"]


def live_pods(api: KubeAPI, namespace: str, name: str) -> list[dict[str, Any]]:
    """The service's pods that are not being deleted."""
    return [pod for pod in service_pods(api, namespace, name) if not pod["metadata"].get("deletionTimestamp")]


def groups_whole(api: KubeAPI, namespace: str, name: str, ranks: int = 2) -> dict[str, Any] | None:
    """The service once its only replica group has all its ranks ready and it is Ready, else None."""
    service = api.get(services_path(namespace, name))
    grouped, ready = condition(service, "GroupsReady"), condition(service, "Ready")
    expected = [{"name": f"{name}-0", "ranks": ranks, "ranksReady": ranks}]
    whole = service.get("status", {}).get("groups") == expected
    if whole and grouped and grouped["status"] == "True" and ready and ready["status"] == "True":
        return service
    return None


def events_for(
    api: KubeAPI, namespace: str, name: str, kind: str = "InferenceService"
) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind={kind},involvedObject.name={name}"
    return api.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector=selector)["items"]


@dataclass(frozen=True)
class ReplicaSample:
    at: float  # monotonic seconds
    desired: int
    ready: int


class ReplicaHistory(BackgroundPoller):
    """Records a Deployment's desired (spec.replicas) and ready replicas whenever either changes."""

    def __init__(self, api: KubeAPI, namespace: str, name: str, interval: float = 0.2) -> None:
        super().__init__(f"replicas-{name}", interval)
        self._api = api
        self._path = deployment_path(namespace, name)
        self.samples: list[ReplicaSample] = []

    def desired_counts(self) -> list[int]:
        """The distinct desired counts in the order they were set (repeats collapsed)."""
        counts: list[int] = []
        for sample in self.snapshot():
            if not counts or counts[-1] != sample.desired:
                counts.append(sample.desired)
        return counts

    def snapshot(self) -> list[ReplicaSample]:
        with self._lock:
            return list(self.samples)

    def first(self, predicate: Any) -> ReplicaSample | None:
        return next((sample for sample in self.snapshot() if predicate(sample)), None)

    def poll(self) -> None:
        try:
            deployment = self._api.get(self._path)
        except ApiError:
            return
        desired = deployment["spec"].get("replicas", 1)
        ready = deployment.get("status", {}).get("readyReplicas", 0)
        with self._lock:
            last = self.samples[-1] if self.samples else None
            if last is None or (last.desired, last.ready) != (desired, ready):
                self.samples.append(ReplicaSample(time.monotonic(), desired, ready))


SUCCESS_METRIC = "vllm:request_success_total"


class FirstAnswers(BackgroundPoller):
    """When each serving pod of a service had answered its first request (monotonic seconds), read from its
    own request counter every `interval` seconds: what its clients saw, whichever way their requests came."""

    def __init__(self, endpoints: ReadyEndpoints, interval: float = 0.5) -> None:
        super().__init__("first-answers", interval)
        self._endpoints = endpoints
        self.first_answer: dict[str, float] = {}

    def poll(self) -> None:
        for endpoint in self._endpoints.current():
            if endpoint.pod not in self.first_answer and _answered(endpoint):
                with self._lock:
                    self.first_answer[endpoint.pod] = time.monotonic()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.first_answer)


def _answered(endpoint: Endpoint) -> bool:
    with urllib.request.urlopen(f"http://{endpoint.ip}:{endpoint.port}/metrics", timeout=2) as page:
        lines = page.read().decode().splitlines()
    return any(line.startswith(SUCCESS_METRIC) and float(line.rsplit(" ", 1)[1]) > 0 for line in lines)
