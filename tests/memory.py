"""Peak memory of a live process, as tests measure it: Linux's VmHWM, reset to the current RSS first."""

from __future__ import annotations

from pathlib import Path


def proc_status_kb(pid: int | str, field: str) -> int:
    """A memory figure (VmRSS, VmHWM) of a live process ("self": this one), in kB, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak_rss(pid: int | str) -> int:
    """Resets the process's peak RSS to its current RSS (clear_refs "5"); returns that figure, in kB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return proc_status_kb(pid, "VmHWM")
