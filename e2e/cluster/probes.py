"""Container probes as a kubelet runs them: httpGet, tcpSocket and exec, with their thresholds."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .pod_spec import ContainerConfigError, container_port


@dataclass(frozen=True)
class Probe:
    kind: str  # "http", "tcp" or "exec"
    host: str
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    def describe(self) -> str:
        if self.kind == "http":
            return f"{self.scheme.lower()}://{self.host}:{self.port}{self.path}"
        if self.kind == "tcp":
            return f"tcp {self.host}:{self.port}"
        return "exec " + " ".join(self.command)


def parse_probe(spec: Mapping[str, Any] | None, container: Mapping[str, Any], pod_ip: str) -> Probe | None:
    """The probe a container declares, with the API's defaults; None when it declares none."""
    if not spec:
        return None
    timing = {
        "initial_delay": float(spec.get("initialDelaySeconds", 0)),
        "period": float(spec.get("periodSeconds", 10)),
        "timeout": float(spec.get("timeoutSeconds", 1)),
        "success_threshold": int(spec.get("successThreshold", 1)),
        "failure_threshold": int(spec.get("failureThreshold", 3)),
    }
    if "httpGet" in spec:
        action = spec["httpGet"]
        return Probe(
            kind="http",
            host=action.get("host") or pod_ip,
            port=container_port(container, action["port"]),
            path=action.get("path", "/"),
            scheme=action.get("scheme", "HTTP"),
            headers=tuple((h["name"], h["value"]) for h in action.get("httpHeaders", [])),
            **timing,
        )
    if "tcpSocket" in spec:
        action = spec["tcpSocket"]
        return Probe(
            kind="tcp",
            host=action.get("host") or pod_ip,
            port=container_port(container, action["port"]),
            **timing,
        )
    if "exec" in spec:
        return Probe(kind="exec", host=pod_ip, command=tuple(spec["exec"]["command"]), **timing)
    raise ContainerConfigError(f"unsupported probe in container {container['name']!r}: {sorted(spec)}")


def run_probe(
    probe: Probe, exec_argv: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> tuple[bool, str]:
    """Runs the probe once: (succeeded, what happened). exec_argv is probe.command resolved for this host."""
    try:
        if probe.kind == "http":
            connection: http.client.HTTPConnection
            if probe.scheme.upper() == "HTTPS":
                # A kubelet does not verify the certificate of what it probes either.
                context = ssl._create_unverified_context()
                connection = http.client.HTTPSConnection(
                    probe.host, probe.port, timeout=probe.timeout, context=context
                )
            else:
                connection = http.client.HTTPConnection(probe.host, probe.port, timeout=probe.timeout)
            try:
                connection.request("GET", probe.path, headers=dict(probe.headers))
                status = connection.getresponse().status
            finally:
                connection.close()
            return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
        if probe.kind == "tcp":
            with socket.create_connection((probe.host, probe.port), timeout=probe.timeout):
                return True, "connected"
        result = subprocess.run(
            list(exec_argv),
            env=dict(env) if env else None,
            capture_output=True,
            timeout=probe.timeout,
            check=False,
        )
        output = (result.stdout + result.stderr).decode(errors="replace").strip()
        return result.returncode == 0, f"exec probe exited with {result.returncode}: {output[-300:]}"
    except subprocess.TimeoutExpired:
        return False, f"probe timed out after {probe.timeout:.0f}s"
    except OSError as error:
        return False, f"Get {probe.describe()}: {error}"


@dataclass
class ProbeTracker:
    """A probe's verdict over time: it flips after successThreshold / failureThreshold results in a row."""

    probe: Probe
    initially_healthy: bool  # a kubelet starts liveness at success, readiness and startup at failure
    healthy: bool = False
    next_due: float = 0.0
    successes: int = 0
    failures: int = 0
    last_message: str = ""

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets past results, as for a (re)started container."""
        self.healthy = self.initially_healthy
        self.successes = self.failures = 0
        self.last_message = ""
        self.next_due = time.monotonic() + self.probe.initial_delay

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, succeeded: bool, message: str, now: float) -> bool:
        """Counts one result; returns True when the healthy verdict changed."""
        self.next_due = now + self.probe.period
        self.last_message = message
        if succeeded:
            self.successes, self.failures = self.successes + 1, 0
            flips = not self.healthy and self.successes >= self.probe.success_threshold
        else:
            self.failures, self.successes = self.failures + 1, 0
            flips = self.healthy and self.failures >= self.probe.failure_threshold
        if flips:
            self.healthy = not self.healthy
        return flips
