"""`kvfleet bench batch` end to end on the tiny model: every row is answered offline and through the
server at each concurrency, and both interactive runs complete."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfleet.cli import cli


def test_bench_batch_compares_run_batch_with_serve_and_measures_ttft(tiny_llama: Path) -> None:
    args = ["bench", "batch", "--model", str(tiny_llama), "--num-rows", "12", "--input-len", "8"]
    args += [
        "--output-len",
        "4",
        "--concurrency",
        "2,12",
        "--interactive-prompts",
        "3",
        "--interactive-rate",
        "5",
    ]
    args += ["--num-gpu-blocks-override", "256", "--dtype", "float32", "--scheduling-policy", "priority"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = result.stdout
    assert output.startswith("12 rows")
    assert re.search(r"^\| `kvfleet run-batch` \| 12 \| [\d.]+ \|$", output, re.MULTILINE)
    served = re.findall(
        r"^\| `kvfleet serve`, concurrency (\d+) \| (\d+) \| [\d.]+ \|$", output, re.MULTILINE
    )
    assert served == [("2", "12"), ("12", "12")]
    assert re.search(r"run-batch / best serve \(concurrency (2|12)\): [\d.]+x", output)
    for run in ("alone", "beside a batch"):
        assert re.search(rf"^\| {run} \| [\d.]+ \| [\d.]+ \|$", output, re.MULTILINE), run
