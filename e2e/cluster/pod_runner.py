"""The pod runner: the kubelet of the fake nodes, for pods whose image is kvfleet.

kwok gives such pods an IP (from a loopback range) and leaves the rest to the runner, which starts the
process each container describes (`kvfleet serve ...` bound to the pod's IP, `kvfleet operator` with a
kubeconfig for the pod's ServiceAccount), reports container states and the Ready condition from the pod's
own probes, restarts containers as the restart policy says, and on deletion runs preStop, sends SIGTERM,
waits out the grace period, and only then removes the pod. Process output goes to one log file per
container under the runner's work folder.

With container_images (pod image -> a local image that `make images` built), those containers run from the
image with podman instead, as a kubelet would run them (pod_container.py): their securityContext,
volumes, environment and limits, on the host network bound to the pod's IP, with in-cluster configuration.

This module watches pods and hands each one it runs to a PodWorker (pod_worker.py); how a container is
launched is container_launch.py, its volumes pod_volumes.py.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .container_launch import Launcher
from .kube_api import ApiError, KubeAPI, WatchStream, pods_path
from .pod_dns import PodDNS
from .pod_spec import DEFAULT_IMAGE_PATTERN, runs_image, secret_strings
from .pod_volumes import PodVolumes
from .pod_worker import PodWorker
from .processes import Ledger
from .service_accounts import ServiceAccounts

__all__ = ["PodRunner"]

log = logging.getLogger("kvfleet.e2e.pod_runner")


def default_kvfleet_executable() -> str:
    """The kvfleet command of the Python environment running this code (tests, the demo)."""
    return str(Path(sys.executable).parent / "kvfleet")


class PodRunner:
    """Watches pods on the fake nodes and runs those with a matching image as real local processes."""

    def __init__(
        self,
        api: KubeAPI,
        work_dir: Path,
        image_pattern: str = DEFAULT_IMAGE_PATTERN,
        server: str = "",
        ca_cert: Path | None = None,
        ledger: Ledger | None = None,
        programs: Mapping[str, str] | None = None,
        container_images: Mapping[str, str] | None = None,
        dns: PodDNS | None = None,
    ) -> None:
        self.api = api
        self.work_dir = work_dir
        self.image_pattern = image_pattern
        self.ledger = ledger
        accounts = ServiceAccounts(api, server, ca_cert)
        self.volumes = PodVolumes(self.lookup, accounts.token)
        self.launcher = Launcher(
            work_dir=work_dir,
            programs={"kvfleet": default_kvfleet_executable(), **(programs or {})},
            container_images=container_images or {},
            server=server,
            dns=dns,
            accounts=accounts,
        )
        self._workers: dict[str, PodWorker] = {}
        self._finished: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watch: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._nodes: dict[str, dict[str, str]] = {}

    def runs(self, container: Mapping[str, Any]) -> bool:
        return runs_image(container.get("image", ""), self.image_pattern)

    def log_path(self, namespace: str, pod_name: str, container: str) -> Path:
        return self.work_dir / namespace / pod_name / f"{container}.log"

    def process_id(self, namespace: str, pod_name: str, container: str) -> int | None:
        """The PID of a container's running process (None when it is not running), e.g. to kill it as a
        crash would: the runner then restarts it as the pod's restart policy says."""
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            if (worker.namespace, worker.pod_name) != (namespace, pod_name):
                continue
            for candidate in worker.containers:
                process = candidate.process
                if candidate.name == container and process is not None and process.running():
                    return process.pid
        return None

    def start(self) -> None:
        missing = {name: path for name, path in self.launcher.programs.items() if not Path(path).exists()}
        if missing:
            raise RuntimeError(
                f"the pod runner's commands are not installed: {missing} (make setup installs kvfleet)"
            )
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch_loop, name="pod-runner-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops watching and kills every process the runner started (pods stay as they are)."""
        self._stopping.set()
        watch = self._watch
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.shutdown()
        for worker in workers:
            worker.join(timeout=60)
        alive = [worker.name for worker in workers if worker.is_alive()]
        if alive:
            raise RuntimeError(f"pod workers did not stop: {alive}")

    def forget(self, uid: str) -> None:
        with self._lock:
            self._workers.pop(uid, None)
            self._finished.add(uid)

    # -- the watch --------------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                listing = self.api.get(pods_path())
                for pod in listing["items"]:
                    self._handle("MODIFIED", pod)
                self._forget_missing({pod["metadata"]["uid"] for pod in listing["items"]})
                resource_version = listing["metadata"]["resourceVersion"]
                while not self._stopping.is_set():
                    self._watch = self.api.watch(pods_path(), resource_version)
                    for event in self._watch:
                        if event["type"] == "ERROR":
                            raise ApiError(
                                "WATCH", pods_path(), event["object"].get("code", 0), str(event["object"])
                            )
                        resource_version = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._handle(event["type"], event["object"])
            except (OSError, ApiError, ValueError) as error:
                if not self._stopping.is_set():
                    log.warning("pod runner watch restarts after: %s", error)
                    self._stopping.wait(1.0)

    def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
        uid = meta["uid"]
        containers = spec.get("initContainers", []) + spec.get("containers", [])
        if not spec.get("nodeName") or not any(self.runs(c) for c in containers):
            return
        with self._lock:
            worker = self._workers.get(uid)
            finished = uid in self._finished
        if kind == "DELETED":
            if worker is not None:
                worker.shutdown()
            return
        deleting = meta.get("deletionTimestamp") is not None
        grace = float(meta.get("deletionGracePeriodSeconds") or spec.get("terminationGracePeriodSeconds", 30))
        if worker is not None:
            if deleting:
                worker.request_deletion(grace)
            return
        if deleting:
            # Never started (or already stopped): nothing to wait for.
            with contextlib.suppress(ApiError):
                self.api.delete(pods_path(meta["namespace"], meta["name"]), {"gracePeriodSeconds": 0})
            return
        if finished or not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
            return
        worker = PodWorker(self, pod)
        with self._lock:
            if self._stopping.is_set():
                return
            self._workers[uid] = worker
        worker.start()

    def _forget_missing(self, present: set[str]) -> None:
        with self._lock:
            gone = [worker for uid, worker in self._workers.items() if uid not in present]
        for worker in gone:
            worker.shutdown()

    # -- what containers need ---------------------------------------------------------------------------

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        try:
            found = self.api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return secret_strings(found) if kind == "Secret" else dict(found.get("data") or {})

    def node_allocatable(self, node_name: str) -> dict[str, str]:
        if node_name not in self._nodes:
            node = self.api.get(f"/api/v1/nodes/{node_name}")
            self._nodes[node_name] = dict(node.get("status", {}).get("allocatable", {}))
        return self._nodes[node_name]
