"""The control plane's binaries: built on first use by build.sh into a cache outside the checkout."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().with_name("build.sh")


def binary_dir() -> Path:
    """Where build.sh puts the binaries (from KVFLEET_CACHE / KVFLEET_K8S_BIN and the pinned versions)."""
    result = subprocess.run([str(BUILD_SCRIPT), "--bin-dir"], capture_output=True, text=True, check=True)
    return Path(result.stdout.strip())


def ensure_binaries(names: Sequence[str] = ()) -> Path:
    """Builds whatever of names (default: all) is missing or stale, showing build.sh's progress on stderr.

    Returns the folder holding the binaries. A cold build takes about ten minutes; a check, about a second.
    """
    result = subprocess.run([str(BUILD_SCRIPT), *names], check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {result.returncode} (its output is above)")
    return binary_dir()
