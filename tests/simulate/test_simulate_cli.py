"""`kvfleet simulate`: a generated trace replayed for two services, reported as JSON and drawn as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from kvfleet.cli import cli


def test_two_services_replay_one_trace_into_one_report_and_one_plot(tmp_path: Path) -> None:
    runner = CliRunner()
    trace = tmp_path / "trace.jsonl"
    generated = runner.invoke(
        cli, ["simulate", "trace", "burst", "--duration-seconds", "60", "--rate", "5", "--out", str(trace)]
    )
    assert generated.exit_code == 0, generated.output
    for name, policy in (("queue-depth", "queue-depth"), ("slo", "slo")):
        spec = {"model": {"uri": "hf://org/model"}, "scaling": {"policy": policy}}
        (tmp_path / f"{name}.yaml").write_text(
            yaml.safe_dump({**spec, "sla": {"ttftTargetMilliseconds": 500}})
        )
    report, png = tmp_path / "report.json", tmp_path / "plot.png"
    services = ["--service", str(tmp_path / "queue-depth.yaml"), "--service", str(tmp_path / "slo.yaml")]
    ran = runner.invoke(
        cli, ["simulate", "run", *services, "--trace", str(trace), "--out", str(report), "--plot", str(png)]
    )
    assert ran.exit_code == 0, ran.output
    summaries = json.loads(report.read_text())
    requests = len(trace.read_text().splitlines())
    assert set(summaries) == {"queue-depth", "slo"}
    assert all(summary["requests"] == requests for summary in summaries.values())
    assert png.read_bytes().startswith(b"\x89PNG")
    refused = runner.invoke(
        cli, ["simulate", "run", *services[:2], "--trace", str(trace), "--out", str(report)]
    )
    assert refused.exit_code == 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"model": {"uri": "hf://org/model"}}))
    no_target = runner.invoke(
        cli,
        [
            "simulate",
            "run",
            "--service",
            str(tmp_path / "bad.yaml"),
            "--trace",
            str(trace),
            "--out",
            str(report),
        ],
    )
    assert no_target.exit_code == 2 and "a TTFT target is needed" in no_target.output
