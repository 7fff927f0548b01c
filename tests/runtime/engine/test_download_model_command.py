"""`kvfleet download-model`, the init container of hf:// models: its failures must be clear and non-zero.

(Its successful download, from a local stand-in for the Hub, is tested with `kvfleet serve`'s Hub models.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-P", "-m", "kvfleet", "download-model", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env)


def test_rejects_a_malformed_repository_id(tmp_path: Path) -> None:
    result = _run("not-a-repo", "--dest", str(tmp_path / "m"))
    assert result.returncode == 2
    assert "org/name" in result.stderr


def test_unreachable_hub_fails_with_the_reason(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = _run("org/model", "--revision", "v1", "--dest", str(tmp_path / "m"), env=env)
    assert result.returncode == 1
    assert "cannot download org/model" in result.stderr
    assert not (tmp_path / "m" / "config.json").exists()
