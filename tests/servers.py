"""`kvfleet serve` processes the tests start: waited for until ready, read, and stopped by their PID.

A module of its own, not a conftest: test modules import it by this name, which no other file shares."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL_NAME = "tiny"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    api_key: str | None
    model_name: str = MODEL_NAME
    # How its certificate is checked, where it serves HTTPS (with the client's certificate, where it asks).
    verify: ssl.SSLContext | bool = True

    @property
    def pid(self) -> int:
        return self.process.pid

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """Samples of the /metrics page whose labels are only model_name, by metric name."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line.startswith("#") or "{" not in line:
                continue
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            if labels == f'model_name="{self.model_name}"':
                samples[name] = float(value)
        return samples

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready within {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(STOP_TIMEOUT_S)
