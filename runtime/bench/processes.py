"""The servers a benchmark starts: `kvfleet serve` and `kvfleet gateway` on loopback, each stopped by its PID
(SIGTERM, then SIGKILL past a bound), with its log in the benchmark's work folder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
from kvfleet.contract.metrics import KVFLEET_PREFIX
from kvfleet.runtime.config import EngineConfig
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "bench"
_READY_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class BenchProcess:
    """A kvfleet command serving HTTP on a free loopback port until stopped."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        *,
        ready_path: str,
        env: Mapping[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        """`cpus`: the CPUs the process and its children may run on (as a pod's CPU limit would keep them);
        any by default."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready_path = ready_path
        self.log = log.open("ab")
        command = [
            sys.executable,
            "-P",
            "-m",
            "kvfleet",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )

    def wait_ready(self, poll_s: float = _POLL_S) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.log.name}: the process exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + self._ready_path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"{self.log.name}: not ready within {_READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


class ServeProcess(BenchProcess):
    """`kvfleet serve` of `config` with `extra_args`, serving the model as MODEL_NAME."""

    def __init__(
        self,
        config: EngineConfig,
        workdir: Path,
        extra_args: list[str],
        *,
        log_name: str = "server.log",
        env: Mapping[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        flags = [
            arg
            for name, value in config.as_options().items()
            if value is not None
            for arg in _flag(name, value)
        ]
        args = ["serve", "--model", config.model, "--served-model-name", MODEL_NAME, *extra_args, *flags]
        super().__init__(args, workdir / log_name, ready_path="/ready", env=env, cpus=cpus)


def counter_totals(urls: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """The replicas' `kvfleet:` counters of `names` (without the prefix and _total), summed over the
    replicas and over the labels."""
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.removeprefix(KVFLEET_PREFIX).removesuffix("_total")
                if name in totals and sample.name.startswith(KVFLEET_PREFIX):
                    totals[name] += sample.value
    return totals


def _flag(name: str, value: object) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, str(value)]
