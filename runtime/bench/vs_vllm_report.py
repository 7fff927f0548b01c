"""The table `make bench-vs-vllm` writes into docs/benchmarks.md, from the result files of one run.

The run's folder holds `load.txt` (the load average before each part) and what the parts it ran wrote:
`serve-<engine>-<rate>.json` (`kvfleet bench serve --save-result`, under vLLM's keys); `plan.json`,
`engine-kvfleet.json` and `engine-vllm.json` (offline throughput and decode step times); and, from the
round beside a busy loop, `engine-<engine>-neighbour.json` and `neighbour-cpu.txt` (the core it was pinned
to). The section between the two markers is replaced, so that a rerun updates the figures and leaves the
rest of the page alone.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

SECTION_START = "<!-- bench-vs-vllm:start -->"
SECTION_END = "<!-- bench-vs-vllm:end -->"
ENGINES = {"kvfleet": "kvfleet", "vllm": "vLLM"}


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: did every part of the run finish?")
    return json.loads(path.read_text())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ms(run: dict[str, float], *keys: str) -> str:
    return " / ".join(f"{run[key]:.1f}" for key in keys)


Row = tuple[str, list[str]]


def _serve_rows(results: Path) -> list[Row]:
    rates = sorted({path.stem.rsplit("-", 1)[1] for path in results.glob("serve-*.json")}, key=float)
    rows: list[Row] = []
    for rate in rates:
        runs = [_load(results / f"serve-{name}-{rate}.json") for name in ENGINES]
        label = f"serve {rate} req/s ({runs[0]['num_prompts']} requests)"
        rows += [
            (f"{label}: achieved req/s", [f"{run['request_throughput']:.2f}" for run in runs]),
            (f"{label}: TTFT p50 / p99 (ms)", [_ms(run, "median_ttft_ms", "p99_ttft_ms") for run in runs]),
            (f"{label}: ITL p50 / p99 (ms)", [_ms(run, "median_itl_ms", "p99_itl_ms") for run in runs]),
            (f"{label}: TPOT p50 (ms)", [_ms(run, "median_tpot_ms") for run in runs]),
        ]
    return rows


def _engine_rows(plan: dict[str, Any], engines: list[dict[str, Any]], where: str) -> list[Row]:
    rows = [
        (
            f"offline{where}, {len(plan['offline'])} requests: output tokens/s",
            [f"{engine['offline']['tokens_per_second']:.0f}" for engine in engines],
        )
    ]
    for batch in plan["decode"]["batch_sizes"]:
        step_ms = [engine["decode_step_ms"][str(batch)] for engine in engines]
        rows.append((f"decode step{where}, batch {batch} (ms)", [f"{ms:.2f}" for ms in step_ms]))
    return rows


def _offline_loss(quiet: dict[str, Any], beside: dict[str, Any]) -> float:
    """The share of offline throughput, in percent, an engine lost beside the neighbour."""
    return (1 - beside["offline"]["tokens_per_second"] / quiet["offline"]["tokens_per_second"]) * 100


def _offline_rows(results: Path) -> tuple[list[Row], dict[str, Any] | None]:
    """The offline rows, with the neighbour's where the run had one, and the engines' own description."""
    if not (results / "plan.json").is_file():
        return [], None
    plan = _load(results / "plan.json")
    quiet = [_load(results / f"engine-{name}.json") for name in ENGINES]
    rows = _engine_rows(plan, quiet, "")
    cpu_file = results / "neighbour-cpu.txt"
    if cpu_file.is_file():
        beside = [_load(results / f"engine-{name}-neighbour.json") for name in ENGINES]
        rows += _engine_rows(plan, beside, f" beside a busy loop on CPU {cpu_file.read_text().strip()}")
        losses = [_offline_loss(q, b) for q, b in zip(quiet, beside, strict=True)]
        rows.append(("offline: throughput lost beside the busy loop (%)", [f"{loss:.1f}" for loss in losses]))
    return rows, dict(zip(ENGINES, quiet, strict=True))


def build_section(results: Path, commit: str) -> str:
    offline_rows, engines = _offline_rows(results)
    rows = _serve_rows(results) + offline_rows
    loads = [line.split() for line in (results / "load.txt").read_text().splitlines() if line.strip()]
    versions = ""
    if engines is not None:
        kvfleet, vllm = engines["kvfleet"], engines["vllm"]
        versions = (
            f": kvfleet with torch {kvfleet['torch']} ({kvfleet['threads']} threads), "
            f"vLLM {vllm['version']} with torch {vllm['torch']}"
        )
    lines = [
        SECTION_START,
        f"Measured {datetime.date.today().isoformat()} at commit {commit} on {os.cpu_count()} CPUs "
        f"({cpu_model()}){versions}. Load average (1 min) before each part: "
        + ", ".join(f"{phase} {one_minute}" for phase, one_minute, *_ in loads)
        + ".",
        "",
        "| measurement | " + " | ".join(ENGINES.values()) + " |",
        "| --- | " + " | ".join("---:" for _ in ENGINES) + " |",
        *(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows),
        SECTION_END,
    ]
    return "\n".join(lines)


def replace_section(doc: Path, section: str) -> None:
    """Put `section` between the markers of `doc`, or append it under a heading when it has none."""
    text = doc.read_text()
    if SECTION_START in text and SECTION_END in text:
        before, rest = text.split(SECTION_START, 1)
        after = rest.split(SECTION_END, 1)[1]
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n## kvfleet against vLLM (CPU)\n\n" + section + "\n"
    doc.write_text(text)
