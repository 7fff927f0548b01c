"""`kvfleet bench step-phases` on the tiny model: every phase of a decode step is reported, none negative."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner
from kvfleet.runtime.bench.step_phases import PHASES

from kvfleet.cli import cli


def test_step_phases_reports_every_phase(tiny_llama: Path) -> None:
    args = ["bench", "step-phases", "--model", str(tiny_llama), "--batch-sizes", "1,3"]
    args += ["--steps", "6", "--rounds", "2", "--num-kv-blocks", "256"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", result.stdout, re.MULTILINE))
    assert rows["phase (ms per step)"] == "batch 1 | batch 3"
    for phase in PHASES:
        values = [float(v) for v in rows[phase].split(" | ")]
        assert len(values) == 2 and all(v >= 0 for v in values), phase
    whole = [float(v.strip("*")) for v in rows["**whole step**"].split(" | ")]
    assert all(v > 0 for v in whole)
    assert float(rows["projections"].split(" | ")[0]) > 0, "the projections were timed"
