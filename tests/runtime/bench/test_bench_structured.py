"""`kvfleet bench structured` end to end on the tiny model: both runs produce as many tokens, and a cached
grammar comes back faster than it compiled."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfleet.cli import cli


def test_bench_structured_reports_throughput_and_compile_times(tiny_llama: Path) -> None:
    args = ["bench", "structured", "--model", str(tiny_llama), "--num-requests", "6", "--rounds", "2"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = result.stdout
    assert "the fastest of 2 alternating rounds" in output
    row = r"\| [\d.]+ \| [\d.]+ \| (\d+) \| [\d.]+ \|$"
    constrained = re.search(r"^\| JSON schema " + row, output, re.MULTILINE)
    unconstrained = re.search(r"^\| unconstrained " + row, output, re.MULTILINE)
    assert constrained and unconstrained
    assert constrained.group(1) == unconstrained.group(1)
    assert re.search(r"masks took [\d.]+ ms per step", output)
    times = re.findall(r"^\| [a-z$ ]+ \| ([\d.]+) \| ([\d.]+) \|$", output, re.MULTILINE)
    assert len(times) == 3
    assert all(float(cached) < float(cold) for cold, cached in times)
