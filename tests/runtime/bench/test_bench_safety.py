"""`kvfleet bench safety` end to end on the tiny model: every policy's requests are all answered (the guard
forced to "safe", the hook answering "not flagged"), and each gets its TTFT and throughput row."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfleet.cli import cli


def test_bench_safety_measures_every_policy(tiny_llama: Path) -> None:
    args = ["bench", "safety", "--model", str(tiny_llama), "--num-prompts", "3", "--throughput-prompts", "4"]
    args += ["--concurrency", "4", "--input-len", "8", "--output-len", "8", "--window-tokens", "4"]
    args += ["--num-kv-blocks", "256", "--dtype", "float32"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = re.findall(
        r"^\| ([^|]+) \| [\d.]+ \| [+-][\d.]+ \| [\d.]+ \| \d+% \| (\d+) \|$", result.stdout, re.MULTILINE
    )
    assert rows == [
        ("none", "7"),
        ("rules on input", "7"),
        ("guard model on input (same server)", "7"),
        ("hook on input", "7"),
        ("rules on output, window 4", "7"),
        ("guard model on output, window 4", "7"),
    ]
