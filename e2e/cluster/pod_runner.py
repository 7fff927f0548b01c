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
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from images.build import podman, run_limits

from .kube_api import ApiError, KubeAPI, WatchStream, pods_path, write_kubeconfig
from .pod_container import container_command, image_config, podman_run_options
from .pod_dns import PodDNS
from .pod_spec import (
    DEFAULT_IMAGE_PATTERN,
    ContainerConfigError,
    bind_to_pod_ip,
    container_argv,
    container_env,
    container_mounts,
    cpu_threads,
    host_path,
    runs_image,
    secret_strings,
)
from .pod_status import PodStatusReporter
from .probes import ProbeTracker, parse_probe, run_probe
from .processes import Ledger, ManagedProcess, start_process

__all__ = ["DEFAULT_IMAGE_PATTERN", "PodRunner"]

log = logging.getLogger("kvfleet.e2e.pod_runner")

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A kubelet starts at 10 s and doubles to 5 minutes; shorter here so a test sees a crash loop quickly.
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
SERVICE_ACCOUNT_TOKEN_SECONDS = 24 * 3600


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def default_kvfleet_executable() -> str:
    """The kvfleet command of the Python environment running this code (tests, the demo)."""
    return str(Path(sys.executable).parent / "kvfleet")


class Container:
    """One container of a pod: its spec, its process (when real), its probes and its restart history."""

    def __init__(self, spec: Mapping[str, Any], real: bool, init: bool) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.image: str = spec.get("image", "")
        self.real = real
        self.init = init
        self.argv: list[str] = []
        # The podman container's name when the container runs from an image, else None (a local process).
        self.podman_name: str | None = None
        self.env: dict[str, str] = {}
        self.cwd: Path | None = None
        self.process: ManagedProcess | None = None
        self.restart_count = 0
        self.started_at = ""
        self.ready = not real
        self.started = not real
        self.completed = False
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "") if real else None
        self.terminated: dict[str, Any] | None = None
        self.last_termination: dict[str, Any] | None = None
        self.restart_at = 0.0
        self.readiness: ProbeTracker | None = None
        self.liveness: ProbeTracker | None = None
        self.startup: ProbeTracker | None = None

    def status(self) -> dict[str, Any]:
        if self.terminated is not None:
            state: dict[str, Any] = {"terminated": self.terminated}
        elif self.waiting is not None:
            reason, message = self.waiting
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        else:
            state = {"running": {"startedAt": self.started_at}}
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.started and self.terminated is None and self.waiting is None,
            "restartCount": self.restart_count,
            "state": state,
        }
        if self.last_termination is not None:
            status["lastState"] = {"terminated": self.last_termination}
        return status


class PodWorker(threading.Thread):
    """Runs one pod from the moment kwok gave it an IP until it is deleted or the runner stops."""

    def __init__(self, runner: PodRunner, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.pod_ip: str = pod["status"]["podIP"]
        self.dir = runner.work_dir / self.namespace / self.pod_name
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.init_containers = [
            Container(c, runner.runs(c), init=True) for c in spec.get("initContainers", [])
        ]
        self.containers = [Container(c, runner.runs(c), init=False) for c in spec.get("containers", [])]
        self.status = PodStatusReporter(
            runner.api, self.namespace, self.pod_name, self.uid, spec.get("nodeName", "")
        )
        self._wake = threading.Event()
        self._delete_grace: float | None = None
        self._kill_deadline: float | None = None  # set when termination began
        self._shutdown = False

    # Called from the runner's watch thread.
    def request_deletion(self, grace_seconds: float) -> None:
        if self._delete_grace is None or grace_seconds < self._delete_grace:
            self._delete_grace = grace_seconds
        self._wake.set()

    def shutdown(self) -> None:
        self._shutdown = True
        self._wake.set()

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod %s/%s: the runner failed", self.namespace, self.pod_name)
        finally:
            self._kill_all(grace_seconds=5.0)
            if self._delete_grace is not None and not self._shutdown:
                self._finalize_deletion()
            self.runner.forget(self.uid)

    def _stopping(self) -> bool:
        return self._shutdown or self._delete_grace is not None

    def _run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            volumes = self.runner.materialize_volumes(self.pod, self.dir / "volumes")
            for container in self.init_containers + self.containers:
                if container.real:
                    self._configure(container, volumes)
        except (ContainerConfigError, ApiError, OSError) as error:
            for container in self.init_containers + self.containers:
                if container.real:
                    container.waiting = ("CreateContainerConfigError", str(error))
            self.status.event("Warning", "Failed", f"Error: {error}")
            self._report()
            while not self._stopping():
                self._wake.wait(1.0)
                self._wake.clear()
            return
        for container in self.init_containers:
            if not self._run_to_completion(container):
                return
        self.status.initialized = True
        for container in self.containers:
            self._start(container)
        self._report()
        while not self._shutdown:
            if self._delete_grace is not None and self._kill_deadline is None:
                self._begin_termination(self._delete_grace)
            if self._kill_deadline is not None and self._terminated():
                break
            self._tick()
            self._report()
            self._wake.wait(self._next_wait())
            self._wake.clear()

    def _begin_termination(self, grace_seconds: float) -> None:
        """preStop hooks, then SIGTERM; probes and status go on until the processes exit or time is up."""
        self._kill_deadline = time.monotonic() + grace_seconds
        for container in self.containers:
            if container.process is not None and container.process.running():
                self.status.event("Normal", "Killing", f"Stopping container {container.name}", container.name)
                self._pre_stop(container, self._kill_deadline)
                container.process.terminate()

    def _terminated(self) -> bool:
        """True once every process has exited, or (after SIGKILL) once the grace period ran out."""
        assert self._kill_deadline is not None
        if time.monotonic() >= self._kill_deadline:
            self._kill_all(grace_seconds=0.0)
            return True
        return all(c.process is None or not c.process.running() for c in self.containers)

    def _configure(self, container: Container, volumes: Mapping[str, Path]) -> None:
        spec = container.spec
        node_allocatable = self.runner.node_allocatable(self.pod["spec"].get("nodeName", ""))
        env = container_env(self.pod, spec, self.runner.lookup, node_allocatable)
        local_image = self.runner.container_images.get(container.image)
        if local_image is not None:
            self._configure_image(container, local_image, env, volumes)
        else:
            self._configure_process(container, env, volumes)
        container.startup = self._tracker(spec.get("startupProbe"), spec, healthy=False)
        container.readiness = self._tracker(spec.get("readinessProbe"), spec, healthy=False)
        container.liveness = self._tracker(spec.get("livenessProbe"), spec, healthy=True)

    def _configure_image(
        self, container: Container, image: str, env: dict[str, str], volumes: Mapping[str, Path]
    ) -> None:
        spec, pod_spec = container.spec, self.pod["spec"]
        # In-cluster configuration as a kubelet gives it: the ServiceAccount's token, CA and namespace in the
        # projected volume the API server added to the pod, and the API server's address (here its own, since
        # Service IPs lead nowhere on this host).
        api_server = urllib.parse.urlsplit(self.runner.server)
        env = {
            "KUBERNETES_SERVICE_HOST": str(api_server.hostname),
            "KUBERNETES_SERVICE_PORT": str(api_server.port),
            **env,
        }
        config = image_config(image)
        options = podman_run_options(pod_spec, spec, env, volumes, config.get("User", ""))
        if self.runner.dns is not None and self.runner.dns.applies(self.pod):
            options += self.runner.dns.podman_options(self.pod)
        entrypoint, args = container_command(spec, env, self.pod_ip, config.get("Entrypoint") or [])
        container.podman_name = f"kvfleet-pod-{self.uid[:13]}-{container.name}"
        # The labels a kubelet's container runtime puts on a pod's containers.
        labels = {
            "io.kubernetes.pod.uid": self.uid,
            "io.kubernetes.pod.namespace": self.namespace,
            "io.kubernetes.pod.name": self.pod_name,
            "io.kubernetes.container.name": container.name,
        }
        container.argv = podman(
            "run", "--rm", "--replace", "--name", container.podman_name, "--network", "host", *run_limits(),
            *(f"--label={key}={value}" for key, value in labels.items()),
            *options, *entrypoint, image, *args,
        )  # fmt: skip
        # The podman client's own environment; the container's is in its options.
        container.env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}
        container.cwd = self.dir

    def _configure_process(
        self, container: Container, env: dict[str, str], volumes: Mapping[str, Path]
    ) -> None:
        spec = container.spec
        mounts = container_mounts(spec, volumes)
        argv = container_argv(spec, env, self.runner.programs)
        argv = [argv[0], *(host_path(part, mounts) for part in argv[1:])]
        container.argv = bind_to_pod_ip(argv, self.pod_ip)
        if self.runner.dns is not None and self.runner.dns.applies(self.pod):
            container.argv = self.runner.dns.process_argv(self.pod, self.dir, container.argv)
        base = {
            "PATH": f"{Path(self.runner.programs['kvfleet']).parent}{os.pathsep}{SYSTEM_PATH}",
            "HOME": str(self.runner.work_dir / "home"),
            "TMPDIR": str(self.runner.work_dir / "tmp"),
            "LANG": "C.UTF-8",
            "HOSTNAME": self.pod_name,
            "PYTHONUNBUFFERED": "1",
            **self.runner.extra_env,
        }
        threads = cpu_threads(spec)
        if threads is not None:
            # What a CPU limit would enforce through the cgroup, told to the thread pools instead.
            base |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        kubeconfig = self.runner.service_account_kubeconfig(self.pod, self.dir)
        if kubeconfig is not None:
            base["KUBECONFIG"] = str(kubeconfig)
        container.env = base | {name: host_path(value, mounts) for name, value in env.items()}
        for path in (base["HOME"], base["TMPDIR"]):
            Path(path).mkdir(parents=True, exist_ok=True)
        working_dir = spec.get("workingDir")
        container.cwd = Path(host_path(working_dir, mounts)) if working_dir else self.dir
        container.cwd.mkdir(parents=True, exist_ok=True)

    def _tracker(self, probe_spec: Any, spec: Mapping[str, Any], healthy: bool) -> ProbeTracker | None:
        probe = parse_probe(probe_spec, spec, self.pod_ip)
        return None if probe is None else ProbeTracker(probe, initially_healthy=healthy)

    def _log_path(self, container: Container) -> Path:
        return self.dir / f"{container.name}.log"

    def _start(self, container: Container) -> None:
        if not container.real:
            container.started_at = _now()
            return
        container.process = start_process(
            f"pod/{self.namespace}/{self.pod_name}/{container.name}",
            container.argv,
            self._log_path(container),
            self.runner.ledger,
            env=container.env,
            cwd=container.cwd,
        )
        container.started_at = _now()
        container.waiting = None
        container.terminated = None
        container.ready = False
        container.started = container.startup is None
        for tracker in (container.startup, container.readiness, container.liveness):
            if tracker is not None:
                tracker.reset()
        if container.readiness is None and container.startup is None:
            container.ready = not container.init
        self.status.event("Normal", "Started", f"Started container {container.name}", container.name)
        log.info(
            "pod %s/%s: started %s (pid %d)",
            self.namespace,
            self.pod_name,
            container.name,
            container.process.pid,
        )

    def _run_to_completion(self, container: Container) -> bool:
        """Runs an init container until it succeeds; False once the pod failed, is deleted or we stop."""
        if not container.real:
            container.completed = container.ready = True
            container.terminated = {
                "exitCode": 0,
                "reason": "Completed",
                "startedAt": _now(),
                "finishedAt": _now(),
            }
            return True
        self._start(container)
        while not self._stopping():
            process = container.process
            if process is not None and not process.running():
                code = self._record_exit(container)
                if code == 0:
                    container.completed = container.ready = True
                    self._report()
                    return True
                if self.restart_policy == "Never":
                    self.status.phase = "Failed"
                    self._report()
                    return False
                self._schedule_restart(container, f"exited with {code}")
            elif process is None and time.monotonic() >= container.restart_at:
                container.restart_count += 1
                self._start(container)
            self._report()
            self._wake.wait(0.5)
            self._wake.clear()
        return False

    def _record_exit(self, container: Container) -> int:
        assert container.process is not None
        code = container.process.popen.returncode
        finished = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": container.started_at,
            "finishedAt": _now(),
        }
        self._stop_container(container, grace_seconds=10.0)
        container.ready = container.started = False
        container.terminated = finished
        return code

    def _tick(self) -> None:
        now = time.monotonic()
        for container in self.containers:
            if not container.real:
                continue
            process = container.process
            if process is not None and not process.running():
                code = self._record_exit(container)
                restart = self.restart_policy == "Always" or (
                    self.restart_policy == "OnFailure" and code != 0
                )
                if restart and self._kill_deadline is None:
                    self._schedule_restart(container, f"exited with {code}")
                else:
                    container.completed = True
            elif (
                process is None
                and container.waiting is not None
                and now >= container.restart_at
                and (self._kill_deadline is None)
            ):
                container.restart_count += 1
                self._start(container)
            elif process is not None:
                self._probe(container, now)
        if all(c.completed for c in self.containers):
            failed = any(c.terminated and c.terminated["exitCode"] != 0 for c in self.containers)
            self.status.phase = "Failed" if failed else "Succeeded"

    def _schedule_restart(self, container: Container, why: str) -> None:
        backoff = RESTART_BACKOFF_SECONDS[min(container.restart_count, len(RESTART_BACKOFF_SECONDS) - 1)]
        container.last_termination = container.terminated
        container.terminated = None
        container.waiting = (
            "CrashLoopBackOff",
            f"back-off {backoff:.0f}s restarting failed container ({why})",
        )
        container.restart_at = time.monotonic() + backoff
        self.status.event(
            "Warning", "BackOff", f"Back-off restarting failed container {container.name}", container.name
        )

    def _probe(self, container: Container, now: float) -> None:
        startup, readiness, liveness = container.startup, container.readiness, container.liveness
        if startup is not None and not startup.healthy:
            if startup.due(now):
                self._run_probe(container, startup)
                if startup.healthy:
                    container.started = True
                    container.ready = readiness is None
                elif startup.failures >= startup.probe.failure_threshold:
                    self._restart_unhealthy(container, "Startup", startup)
            return
        if (
            liveness is not None
            and liveness.due(now)
            and self._run_probe(container, liveness)
            and not liveness.healthy
        ):
            self._restart_unhealthy(container, "Liveness", liveness)
            return
        if readiness is not None and readiness.due(now):
            self._run_probe(container, readiness)
            container.ready = readiness.healthy

    def _run_probe(self, container: Container, tracker: ProbeTracker) -> bool:
        exec_argv: list[str] = []
        if tracker.probe.kind == "exec":
            exec_argv = self._exec_argv(container, tracker.probe.command)
        succeeded, message = run_probe(tracker.probe, exec_argv, container.env)
        changed = tracker.record(succeeded, message, time.monotonic())
        if not succeeded and tracker.failures == 1:
            kind = {id(container.readiness): "Readiness", id(container.liveness): "Liveness"}.get(
                id(tracker), "Startup"
            )
            self.status.event("Warning", "Unhealthy", f"{kind} probe failed: {message}", container.name)
        return changed

    def _restart_unhealthy(self, container: Container, kind: str, tracker: ProbeTracker) -> None:
        self.status.event(
            "Normal",
            "Killing",
            f"Container {container.name} failed {kind.lower()} probe, will be restarted",
            container.name,
        )
        assert container.process is not None
        container.process.stop(self._grace_period())
        self._record_exit(container)
        self._schedule_restart(container, f"{kind.lower()} probe failed: {tracker.last_message}")

    def _grace_period(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _next_wait(self) -> float:
        now = time.monotonic()
        due = [now + 0.5]  # notices process exits promptly
        for container in self.containers:
            for tracker in (container.startup, container.readiness, container.liveness):
                if tracker is not None and container.process is not None:
                    due.append(tracker.next_due)
            if container.process is None and container.waiting is not None:
                due.append(container.restart_at)
        return max(0.05, min(due) - now)

    def _pre_stop(self, container: Container, deadline: float) -> None:
        hook = container.spec.get("lifecycle", {}).get("preStop")
        if not hook:
            return
        remaining = max(0.0, deadline - time.monotonic())
        if "sleep" in hook:
            time.sleep(min(float(hook["sleep"]["seconds"]), remaining))
            return
        probe = parse_probe({**hook, "timeoutSeconds": max(1, int(remaining))}, container.spec, self.pod_ip)
        if probe is not None:
            exec_argv = self._exec_argv(container, probe.command) if probe.kind == "exec" else []
            succeeded, message = run_probe(probe, exec_argv, container.env)
            if not succeeded:
                self.status.event("Warning", "FailedPreStopHook", message, container.name)

    def _exec_argv(self, container: Container, command: tuple[str, ...] | list[str]) -> list[str]:
        """An exec probe's or hook's command: inside the container when it runs from an image."""
        if container.podman_name is not None:
            return podman("exec", container.podman_name, *command)
        return self.runner.exec_argv(command)

    def _kill_all(self, grace_seconds: float) -> None:
        for container in self.init_containers + self.containers:
            if container.process is not None:
                self._stop_container(container, grace_seconds)

    def _stop_container(self, container: Container, grace_seconds: float) -> None:
        """Stops the container's process; one run from an image is also removed, since a podman client killed
        after the grace period leaves its container running."""
        assert container.process is not None
        container.process.stop(grace_seconds)
        container.process = None
        if container.podman_name is not None:
            subprocess.run(podman("rm", "--force", "--time", "0", container.podman_name), capture_output=True)

    def _finalize_deletion(self) -> None:
        with contextlib.suppress(ApiError):
            self.runner.api.delete(
                pods_path(self.namespace, self.pod_name),
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )

    def _report(self) -> None:
        if not self._shutdown:
            self.status.report(self.init_containers, self.containers)


class PodRunner:
    """Watches pods on the fake nodes and runs those with a matching image as real local processes."""

    def __init__(
        self,
        api: KubeAPI,
        work_dir: Path,
        image_pattern: str = DEFAULT_IMAGE_PATTERN,
        server: str = "",
        ca_cert: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        ledger: Ledger | None = None,
        programs: Mapping[str, str] | None = None,
        container_images: Mapping[str, str] | None = None,
        dns: PodDNS | None = None,
    ) -> None:
        self.api = api
        self.work_dir = work_dir
        self.image_pattern = image_pattern
        self.server = server
        self.ca_cert = ca_cert
        self.extra_env = dict(extra_env or {})
        self.ledger = ledger
        # The commands the image provides: name -> executable on this host.
        self.programs = {"kvfleet": default_kvfleet_executable(), **(programs or {})}
        # Pod images whose containers run from a local image with podman: pod image -> local image.
        self.container_images = dict(container_images or {})
        # The cluster DNS that pods' resolvers are pointed at; None: pods use the host's resolver.
        self.dns = dns
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
        missing = {name: path for name, path in self.programs.items() if not Path(path).exists()}
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

    def exec_argv(self, command: tuple[str, ...] | list[str]) -> list[str]:
        """An exec hook or probe's command on this host: the image's commands map to their executables."""
        argv = list(command)
        if argv and os.path.basename(argv[0]) in self.programs:
            argv[0] = self.programs[os.path.basename(argv[0])]
        return argv

    def service_account_token(self, pod: Mapping[str, Any]) -> str:
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": SERVICE_ACCOUNT_TOKEN_SECONDS,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        return self.api.create(path, request)["status"]["token"]

    def service_account_kubeconfig(self, pod: Mapping[str, Any], pod_dir: Path) -> Path | None:
        """A kubeconfig with the pod's ServiceAccount token: processes get exactly the pod's RBAC rights."""
        if pod["spec"].get("automountServiceAccountToken") is False or self.ca_cert is None:
            return None
        path = pod_dir / "kubeconfig"
        if not path.exists():
            token = self.service_account_token(pod)
            write_kubeconfig(path, self.server, self.ca_cert, "pod", token, pod["metadata"]["namespace"])
        return path

    def materialize_volumes(self, pod: Mapping[str, Any], root: Path) -> dict[str, Path]:
        """Host folders standing in for the pod's volumes; volumes of other kinds are left out."""
        volumes: dict[str, Path] = {}
        namespace = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes", []):
            name = volume["name"]
            target = root / name
            if "hostPath" in volume:
                volumes[name] = Path(volume["hostPath"]["path"])
                if volume["hostPath"].get("type") == "DirectoryOrCreate":
                    volumes[name].mkdir(parents=True, exist_ok=True)
                continue
            if "emptyDir" in volume:
                target.mkdir(parents=True, exist_ok=True)
                target.chmod(0o777)  # as a kubelet makes it: any container user writes it
            elif "configMap" in volume or "secret" in volume:
                kind, source = (
                    ("ConfigMap", volume["configMap"])
                    if "configMap" in volume
                    else ("Secret", volume["secret"])
                )
                ref = {
                    "name": source.get("name") or source.get("secretName"),
                    "optional": source.get("optional", False),
                }
                data = self._referenced(kind, namespace, ref)
                self._write_items(target, data or {}, source.get("items"))
            elif "projected" in volume:
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                for source in volume["projected"].get("sources", []):
                    self._project(target, pod, source)
            else:
                continue
            volumes[name] = target
        return volumes

    def _referenced(self, kind: str, namespace: str, ref: Mapping[str, Any]) -> dict[str, str] | None:
        data = self.lookup(kind, namespace, ref["name"])
        if data is None and not ref.get("optional", False):
            raise ContainerConfigError(f"{kind} {namespace}/{ref['name']} not found")
        return data

    @staticmethod
    def _write_items(target: Path, data: Mapping[str, str], items: list[dict[str, str]] | None) -> None:
        target.mkdir(parents=True, exist_ok=True)
        chosen = {item["key"]: item["path"] for item in items} if items else {key: key for key in data}
        for key, relative in chosen.items():
            if key in data:
                (target / relative).parent.mkdir(parents=True, exist_ok=True)
                (target / relative).write_text(data[key])

    def _project(self, target: Path, pod: Mapping[str, Any], source: Mapping[str, Any]) -> None:
        namespace = pod["metadata"]["namespace"]
        if "serviceAccountToken" in source:
            (target / source["serviceAccountToken"]["path"]).write_text(self.service_account_token(pod))
        elif "configMap" in source or "secret" in source:
            kind, ref = (
                ("ConfigMap", source["configMap"]) if "configMap" in source else ("Secret", source["secret"])
            )
            self._write_items(target, self._referenced(kind, namespace, ref) or {}, ref.get("items"))
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items", []):
                if "fieldRef" in item:
                    field = item["fieldRef"]["fieldPath"]
                    value = {"metadata.namespace": namespace, "metadata.name": pod["metadata"]["name"]}.get(
                        field
                    )
                    if value is None:
                        raise ContainerConfigError(f"unsupported downwardAPI field {field!r}")
                    (target / item["path"]).write_text(value)
