"""Child processes that are always stopped by the PID they were started with.

Each process leads its own process group, so stopping it also stops whatever it spawned. Every start is
recorded in a ledger file next to the logs, so a run that died without cleaning up (SIGKILL, power loss)
is cleaned up by the next one, or by `python -m e2e.cluster down`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The kernel's start time of pid (clock ticks since boot), or None if it is gone.

    Together with the PID it identifies a process for good: a recycled PID has a different start time.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after its last ')' are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, for error messages."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"


class Ledger:
    """A JSON file listing the processes a cluster started: name -> {pid, start_ticks}."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, int]]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _write(self, entries: dict[str, dict[str, int]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def add(self, key: str, pid: int, start_ticks: int) -> None:
        with self._lock:
            entries = self._read()
            entries[key] = {"pid": pid, "start_ticks": start_ticks}
            self._write(entries)

    def remove(self, key: str) -> None:
        with self._lock:
            entries = self._read()
            if entries.pop(key, None) is not None:
                self._write(entries)

    def stop_all(self, grace_seconds: float = 5.0) -> list[str]:
        """Stops every recorded process that still runs; returns the keys it had to stop."""
        with self._lock:
            entries = self._read()
        stopped = []
        for key, entry in sorted(entries.items()):
            if process_start_ticks(entry["pid"]) == entry["start_ticks"]:
                stop_group(entry["pid"], grace_seconds)
                stopped.append(key)
            self.remove(key)
        return stopped


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_group(pid: int, grace_seconds: float) -> None:
    """SIGTERM to the process group led by pid, SIGKILL after the grace period (for a process we did not
    spawn ourselves, so cannot wait() for)."""
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and process_start_ticks(pid) is not None:
        time.sleep(0.05)
    _signal_group(pid, signal.SIGKILL)


@dataclass
class ManagedProcess:
    """A started child: its PID, its log file and the ledger entry that outlives a crash of this process."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ledger: Ledger | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def describe_exit(self) -> str:
        return (
            f"{self.name} (pid {self.pid}) exited with {self.popen.returncode}; log {self.log_path}:\n"
            + tail(self.log_path)
        )

    def terminate(self) -> None:
        """Asks the process group to exit (SIGTERM) without waiting."""
        if self.popen.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)

    def stop(self, grace_seconds: float = 10.0) -> int:
        """Stops the process and its group; returns its exit code (negative: the signal that ended it)."""
        if self.popen.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.popen.wait()
        # Children that outlived their leader still belong to its group.
        _signal_group(self.pid, signal.SIGKILL)
        if self.ledger is not None:
            self.ledger.remove(self.name)
        return self.popen.returncode


def start_process(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    ledger: Ledger | None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ManagedProcess:
    """Starts argv in its own process group with stdout and stderr appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    process = ManagedProcess(name, popen, log_path, ledger)
    if ledger is not None:
        ticks = process_start_ticks(popen.pid)
        if ticks is not None:
            ledger.add(name, popen.pid, ticks)
    return process
