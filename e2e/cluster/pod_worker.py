"""One pod's life on a fake node, as a kubelet runs it.

Init containers run to completion in order, then the containers start; their probes decide started, ready
and restarts, and the restart policy what follows an exit. On deletion each container's preStop hook runs,
then SIGTERM, and SIGKILL once the grace period is over; only then is the pod removed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .container_state import Container
from .kube_api import ApiError, now_timestamp, pods_path
from .pod_spec import ContainerConfigError, container_env
from .pod_status import PodStatusReporter
from .probes import ProbeTracker, parse_probe, run_probe
from .processes import start_process

if TYPE_CHECKING:
    from .pod_runner import PodRunner

log = logging.getLogger("kvfleet.e2e.pod_runner")

CONFIGURE_RETRY_SECONDS = 1.0


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
        # A kubelet tries a pod it could not configure again on its next sync: what was missing (a namespace's
        # kube-root-ca.crt, published a moment after the namespace; a Secret applied after the pod) may come.
        while not self._configure_all():
            self._wake.wait(CONFIGURE_RETRY_SECONDS)
            self._wake.clear()
            if self._stopping():
                return
        for container in self.init_containers:
            if not self._run_to_completion(container):
                return
        self.status.initialized = True
        for container in self.containers:
            self._start(container)
        self._report()
        self._supervise()

    def _supervise(self) -> None:
        """Watches the running containers until the pod is terminated or the runner stops."""
        while not self._shutdown:
            if self._delete_grace is not None and self._kill_deadline is None:
                self._begin_termination(self._delete_grace)
            if self._kill_deadline is not None and self._terminated():
                break
            self._tick()
            self._report()
            self._wake.wait(self._next_wait())
            self._wake.clear()

    # -- configuration ----------------------------------------------------------------------------------

    def _configure_all(self) -> bool:
        """Prepares every real container's launch and probes; False, reported, when the pod asks for what
        cannot be given (a kubelet's CreateContainerConfigError)."""
        real = [c for c in self.init_containers + self.containers if c.real]
        try:
            volumes = self.runner.volumes.materialize(self.pod, self.dir / "volumes")
            for container in real:
                self._configure(container, volumes)
        except (ContainerConfigError, ApiError, OSError) as error:
            waiting = ("CreateContainerConfigError", str(error))
            if any(container.waiting != waiting for container in real):
                self.status.event("Warning", "Failed", f"Error: {error}")
            for container in real:
                container.waiting = waiting
            self._report()
            return False
        return True

    def _configure(self, container: Container, volumes: Mapping[str, Path]) -> None:
        spec = container.spec
        node_allocatable = self.runner.node_allocatable(self.pod["spec"].get("nodeName", ""))
        env = container_env(self.pod, spec, self.runner.lookup, node_allocatable)
        container.launch = self.runner.launcher.launch(self.pod, spec, env, volumes, self.dir)
        container.startup = self._tracker(spec.get("startupProbe"), spec, healthy=False)
        container.readiness = self._tracker(spec.get("readinessProbe"), spec, healthy=False)
        container.liveness = self._tracker(spec.get("livenessProbe"), spec, healthy=True)

    def _tracker(self, probe_spec: Any, spec: Mapping[str, Any], healthy: bool) -> ProbeTracker | None:
        probe = parse_probe(probe_spec, spec, self.pod_ip)
        return None if probe is None else ProbeTracker(probe, initially_healthy=healthy)

    # -- processes --------------------------------------------------------------------------------------

    def _start(self, container: Container) -> None:
        if not container.real:
            container.started_at = now_timestamp()
            return
        launch = container.launch
        process = start_process(
            f"pod/{self.namespace}/{self.pod_name}/{container.name}",
            launch.argv,
            self.runner.log_path(self.namespace, self.pod_name, container.name),
            self.runner.ledger,
            env=launch.env,
            cwd=launch.cwd,
        )
        container.began(process)
        self.status.event("Normal", "Started", f"Started container {container.name}", container.name)
        log.info("pod %s/%s: started %s (pid %d)", self.namespace, self.pod_name, container.name, process.pid)

    def _run_to_completion(self, container: Container) -> bool:
        """Runs an init container until it succeeds; False once the pod failed, is deleted or we stop."""
        if not container.real:
            container.complete_unrun()
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

    def _record_exit(self, container: Container) -> int:
        assert container.process is not None
        code = container.process.popen.returncode
        finished_at = now_timestamp()
        self._stop_container(container, grace_seconds=10.0)
        container.ended(code, finished_at)
        return code

    def _schedule_restart(self, container: Container, why: str) -> None:
        container.back_off(why)
        self.status.event(
            "Warning", "BackOff", f"Back-off restarting failed container {container.name}", container.name
        )

    def _next_wait(self) -> float:
        now = time.monotonic()
        due = [now + 0.5]  # notices process exits promptly
        for container in self.containers:
            if container.process is not None:
                due += [tracker.next_due for tracker in container.trackers()]
            elif container.waiting is not None:
                due.append(container.restart_at)
        return max(0.05, min(due) - now)

    # -- probes and hooks -------------------------------------------------------------------------------

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
        succeeded, message = run_probe(tracker.probe, exec_argv, container.launch.env)
        changed = tracker.record(succeeded, message, time.monotonic())
        if not succeeded and tracker.failures == 1:
            kind = container.probe_kind(tracker)
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
            succeeded, message = run_probe(probe, exec_argv, container.launch.env)
            if not succeeded:
                self.status.event("Warning", "FailedPreStopHook", message, container.name)

    def _exec_argv(self, container: Container, command: Sequence[str]) -> list[str]:
        return self.runner.launcher.exec_argv(container.launch, command)

    # -- termination ------------------------------------------------------------------------------------

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

    def _kill_all(self, grace_seconds: float) -> None:
        for container in self.init_containers + self.containers:
            if container.process is not None:
                self._stop_container(container, grace_seconds)

    def _stop_container(self, container: Container, grace_seconds: float) -> None:
        assert container.process is not None
        container.process.stop(grace_seconds)
        container.process = None
        self.runner.launcher.remove(container.launch)

    def _finalize_deletion(self) -> None:
        with contextlib.suppress(ApiError):
            self.runner.api.delete(
                pods_path(self.namespace, self.pod_name),
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )

    def _report(self) -> None:
        if not self._shutdown:
            self.status.report(self.init_containers, self.containers)
