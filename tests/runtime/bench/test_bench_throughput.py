"""`kvfleet bench throughput` end to end on the tiny model: every section runs and reports."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfleet.cli import cli


def test_bench_throughput_reports_every_section(tiny_llama: Path) -> None:
    args = ["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "4", "--batch-sizes", "2"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = result.stdout
    assert re.search(r"^\| kvfleet \| [\d.]+ \| \d+ \| [\d.]+ \|$", output, re.MULTILINE)
    assert re.search(r"^\| transformers batch 2 \|", output, re.MULTILINE)
    assert re.search(r"^\| prefix caching on \| [\d.]+ \| \d+ \| [\d.]+% \|$", output, re.MULTILINE)
    saved = re.search(r"prefill tokens saved by prefix caching: ([\d.]+)%", output)
    assert saved and float(saved.group(1)) > 50, "the shared-prefix workload hits the cache"
    cost = re.search(r"nothing shared; hit rate ([\d.]+)%.*cost of prefix caching: (-?[\d.]+)%", output)
    assert cost and float(cost.group(1)) < 5, "random prompts share (almost) nothing"
