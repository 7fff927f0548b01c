"""The processes a test's code started, found from outside: by the parent pid each one's /proc stat gives (its
parent process's, whichever of that process's threads started it; a thread's own list of children loses
those that move to another thread when it ends)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> set[int]:
    """The pids of the processes whose parent is `pid`, a zombie not yet reaped included."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # it ended while the others were read
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found
