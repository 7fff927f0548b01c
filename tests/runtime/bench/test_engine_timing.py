"""kvfleet's side of `make bench-vs-vllm` on the tiny model: the plan, the measurements, the report's page
update. vLLM itself is not needed (nor imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from kvfleet.runtime.bench import engine_measure
from kvfleet.runtime.bench.vs_vllm_report import SECTION_END, SECTION_START, replace_section

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
