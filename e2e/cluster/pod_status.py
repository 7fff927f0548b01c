"""Reports a pod's state to the API server as a kubelet does: status conditions, container states, events."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .kube_api import ApiError, KubeAPI, now_timestamp, pods_path

if TYPE_CHECKING:
    from .container_state import Container

log = logging.getLogger("kvfleet.e2e.pod_runner")

COMPONENT = "kvfleet-pod-runner"


class PodStatusReporter:
    """Patches the pod's status when what the containers do changes; conditions keep their transition time."""

    def __init__(self, api: KubeAPI, namespace: str, pod_name: str, uid: str, node_name: str) -> None:
        self.api = api
        self.namespace = namespace
        self.pod_name = pod_name
        self.uid = uid
        self.node_name = node_name
        self.initialized = False
        self.phase: str | None = None  # set once the pod has ended: Succeeded or Failed
        self._transitions: dict[str, tuple[bool, str]] = {}
        self._last_sent: dict[str, Any] | None = None

    def _condition(self, kind: str, status: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, now_timestamp())
        condition = {"type": kind, "status": str(status), "lastTransitionTime": self._transitions[kind][1]}
        if not status and reason:
            condition |= {"reason": reason, "message": message}
        return condition

    def body(self, init_containers: Sequence[Container], containers: Sequence[Container]) -> dict[str, Any]:
        unready = [c.name for c in containers if not c.ready]
        uninitialized = [c.name for c in init_containers if not c.completed]
        ready = not unready and self.initialized and self.phase is None
        not_ready_message = f"containers with unready status: [{' '.join(unready)}]"
        if self.phase is not None:
            phase = self.phase
        elif self.initialized and all(c.started_at for c in containers):
            phase = "Running"
        else:
            phase = "Pending"
        conditions = [
            self._condition("PodReadyToStartContainers", True),
            self._condition(
                "Initialized",
                self.initialized or not init_containers,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(uninitialized)}]",
            ),
            self._condition("ContainersReady", ready, "ContainersNotReady", not_ready_message),
            self._condition("Ready", ready, "ContainersNotReady", not_ready_message),
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [c.status() for c in containers],
        }
        if init_containers:
            status["initContainerStatuses"] = [c.status() for c in init_containers]
        return {"status": status}

    def report(self, init_containers: Sequence[Container], containers: Sequence[Container]) -> None:
        body = self.body(init_containers, containers)
        if body == self._last_sent:
            return
        try:
            self.api.patch(pods_path(self.namespace, self.pod_name, "status"), body)
            self._last_sent = body
        except ApiError as error:
            if error.status != 404:  # a pod deleted meanwhile needs no status
                log.warning("pod %s/%s: status update failed: %s", self.namespace, self.pod_name, error)

    def event(self, kind: str, reason: str, message: str, container: str | None = None) -> None:
        now = now_timestamp()
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": self.namespace,
            "name": self.pod_name,
            "uid": self.uid,
        }
        if container is not None:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.pod_name}.", "namespace": self.namespace},
            "involvedObject": involved,
            "type": kind,
            "reason": reason,
            "message": message,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.create(f"/api/v1/namespaces/{self.namespace}/events", event)
        except ApiError as error:
            log.warning("pod %s/%s: event %s not recorded: %s", self.namespace, self.pod_name, reason, error)
