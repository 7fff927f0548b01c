"""The GPU benchmark script runs end to end on the CPU (`--smoke`: toy sizes, Triton's interpreter), so it
cannot rot between the rare runs on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "run.py"


@pytest.mark.slow
def test_benchmark_script_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "section.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--no-sweep", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    for kernel in (
        "paged attention, decode",
        "paged attention, split-KV decode (2 splits)",
        "paged attention, prefill",
        "paged attention, mixed step",
        "fused add + RMSNorm",
        "rotary embedding, in place",
        "SiLU and mul",
        "KV cache write",
        "batched LoRA, decode",
        "batched LoRA, prefill",
    ):
        assert f"| {kernel}" in report
    assert "FAIL" not in report
    assert report.count("| ok (") >= 10
