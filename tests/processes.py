"""The processes a test's code started, found from outside: by the parent pid each one's /proc stat gives (its
parent process's, whichever of that process's threads started it; a thread's own list of children loses
those that move to another thread when it ends)."""

from __future__ import annotations

from pathlib import Path


def child_processes(pid: int) -> dict[int, str]:
    """Child processes of pid, with their command lines."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if parent == pid:
            children[int(entry.name)] = command
    return children


def descendants(pid: int) -> dict[int, str]:
    """Descendants of pid, with their command lines."""
    found = {}
    for child, command in child_processes(pid).items():
        found[child] = command
        found.update(descendants(child))
    return found
