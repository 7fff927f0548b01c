"""One container of a pod as the pod runner tracks it: how it is launched, its process, probes and restarts.

The transitions a kubelet reports (waiting, running, terminated, back-off) are written here once; the pod
worker decides when they happen.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .container_launch import Launch
from .kube_api import now_timestamp
from .probes import ProbeTracker
from .processes import ManagedProcess

# A kubelet starts at 10 s and doubles to 5 minutes; shorter here so a test sees a crash loop quickly.
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class Container:
    """One container of a pod: its spec, its process (when real), its probes and its restart history."""

    def __init__(self, spec: Mapping[str, Any], real: bool, init: bool) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.image: str = spec.get("image", "")
        self.real = real
        self.init = init
        self.launch = Launch()
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

    def trackers(self) -> list[ProbeTracker]:
        return [t for t in (self.startup, self.readiness, self.liveness) if t is not None]

    def began(self, process: ManagedProcess) -> None:
        """Its process started: the last run's state is cleared and the probes start over."""
        self.process = process
        self.started_at = now_timestamp()
        self.waiting = None
        self.terminated = None
        self.ready = False
        self.started = self.startup is None
        for tracker in self.trackers():
            tracker.reset()
        if self.readiness is None and self.startup is None:
            self.ready = not self.init

    def ended(self, exit_code: int, finished_at: str) -> None:
        """Its process exited with exit_code (negative: the signal that ended it)."""
        self.ready = self.started = False
        self.terminated = {
            "exitCode": exit_code if exit_code >= 0 else 128 - exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": self.started_at,
            "finishedAt": finished_at,
        }

    def complete_unrun(self) -> None:
        """An init container kwok fakes: it counts as run and succeeded at once."""
        self.completed = self.ready = True
        self.terminated = {
            "exitCode": 0,
            "reason": "Completed",
            "startedAt": now_timestamp(),
            "finishedAt": now_timestamp(),
        }

    def back_off(self, why: str) -> None:
        """Waits to be restarted, each time of a crash loop longer."""
        backoff = RESTART_BACKOFF_SECONDS[min(self.restart_count, len(RESTART_BACKOFF_SECONDS) - 1)]
        self.last_termination = self.terminated
        self.terminated = None
        self.waiting = ("CrashLoopBackOff", f"back-off {backoff:.0f}s restarting failed container ({why})")
        self.restart_at = time.monotonic() + backoff

    def probe_kind(self, tracker: ProbeTracker) -> str:
        if tracker is self.readiness:
            return "Readiness"
        return "Liveness" if tracker is self.liveness else "Startup"

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
