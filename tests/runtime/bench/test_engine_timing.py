"""kvfleet's side of `make bench-vs-vllm` on the tiny model: the plan, the measurements, the report's page
update. vLLM itself is not needed (nor imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from kvfleet.runtime.bench import engine_measure
from kvfleet.runtime.bench.vs_vllm_report import SECTION_END, SECTION_START, build_section, replace_section

from kvfleet.cli import cli


def test_engine_timing_writes_the_plan_and_kvfleets_figures(tiny_llama: Path, tmp_path: Path) -> None:
    plan_path, result_path = tmp_path / "plan.json", tmp_path / "kvfleet.json"
    args = ["bench", "engine-timing", "--model", str(tiny_llama), "--plan", str(plan_path)]
    args += ["--result-json", str(result_path), "--num-requests", "12", "--max-num-seqs", "8"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output

    plan = json.loads(plan_path.read_text())
    assert plan["max_num_seqs"] == 8 and plan["cpu_kv_cache_space"] == 1
    assert len(plan["offline"]) == 12
    assert all(
        16 <= len(r["prompt_token_ids"]) <= 256 and 16 <= r["output_len"] <= 128 for r in plan["offline"]
    )
    decode = plan["decode"]
    assert decode["batch_sizes"] == [1, 8] and len(decode["prompts"]) == 8
    assert len({tuple(p) for p in decode["prompts"]}) == 8, "each request of a batch has its own prompt"

    figures = json.loads(result_path.read_text())
    offline = figures["offline"]
    assert offline["output_tokens"] == sum(r["output_len"] for r in plan["offline"])
    assert offline["tokens_per_second"] == offline["output_tokens"] / offline["seconds"]
    assert set(figures["decode_step_ms"]) == {"1", "8"}
    assert all(ms > 0 for ms in figures["decode_step_ms"].values())


def test_the_measuring_code_needs_only_the_standard_library() -> None:
    """vLLM's side loads engine_measure.py as a plain file from vLLM's environment: no site-packages."""
    folder = Path(engine_measure.__file__).parent
    code = f"import sys; sys.path.insert(0, {str(folder)!r}); import engine_measure; print('ok')"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


def test_report_replaces_its_section_and_leaves_the_page_alone(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    replace_section(doc, f"{SECTION_START}\nfirst\n{SECTION_END}")
    first = doc.read_text()
    assert first.startswith("# Benchmarks\n\nintro\n") and "first" in first
    doc.write_text(first + "\n## Later section\n\ntext\n")
    replace_section(doc, f"{SECTION_START}\nsecond\n{SECTION_END}")
    second = doc.read_text()
    assert "first" not in second and second.count(SECTION_START) == 1
    assert second == first.replace("first", "second") + "\n## Later section\n\ntext\n"


def test_report_gives_each_engines_loss_beside_the_busy_loop(tmp_path: Path) -> None:
    """An offline-only run with the neighbour: the quiet rows, the rows beside it, and the loss of each."""
    plan = {"offline": [{}] * 64, "decode": {"batch_sizes": [1, 8]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    tokens_per_second = {("kvfleet", ""): 404.0, ("vllm", ""): 279.0}
    tokens_per_second |= {("kvfleet", "-neighbour"): 184.0, ("vllm", "-neighbour"): 197.0}
    for (name, suffix), rate in tokens_per_second.items():
        figures = {"offline": {"tokens_per_second": rate}, "decode_step_ms": {"1": 10.0, "8": 12.5}}
        figures |= {"torch": "2.x", "threads": 2, "version": "0.x"}
        (tmp_path / f"engine-{name}{suffix}.json").write_text(json.dumps(figures))
    (tmp_path / "neighbour-cpu.txt").write_text("0\n")
    (tmp_path / "load.txt").write_text("kvfleet-offline 0.50 0.4 0.3\nend 1.50 1 1\n")

    rows = {}
    for line in build_section(tmp_path, "abc1234").splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            label, *cells = (cell.strip() for cell in line.strip("|").split("|"))
            rows[label] = cells
    assert not any(label.startswith("serve") for label in rows), "the run had no serving part"
    assert rows["offline, 64 requests: output tokens/s"] == ["404", "279"]
    assert rows["offline beside a busy loop on CPU 0, 64 requests: output tokens/s"] == ["184", "197"]
    assert rows["decode step beside a busy loop on CPU 0, batch 8 (ms)"] == ["12.50", "12.50"]
    losses = [float(cell) for cell in rows["offline: throughput lost beside the busy loop (%)"]]
    for loss, name in zip(losses, ["kvfleet", "vllm"], strict=True):
        quiet, beside = tokens_per_second[name, ""], tokens_per_second[name, "-neighbour"]
        assert abs(loss - 100 * (quiet - beside) / quiet) < 0.05
