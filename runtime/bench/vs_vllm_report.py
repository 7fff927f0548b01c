"""The table `make bench-vs-vllm` writes into docs/benchmarks.md, from the result files of one run.

The run's folder holds `plan.json`, `engine-kvfleet.json` and `engine-vllm.json` (offline throughput and
decode step times), `serve-<engine>-<rate>.json` (`kvfleet bench serve --save-result`, under vLLM's keys)
and `load.txt` (the load average before each part). The section between the two markers is replaced, so
that a rerun updates the figures and leaves the rest of the page alone.
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


def build_section(results: Path, commit: str) -> str:
    plan = _load(results / "plan.json")
    engines = {name: _load(results / f"engine-{name}.json") for name in ENGINES}
    rates = sorted({path.stem.rsplit("-", 1)[1] for path in results.glob("serve-*.json")}, key=float)
    serve = {(name, rate): _load(results / f"serve-{name}-{rate}.json") for name in ENGINES for rate in rates}
    rows: list[tuple[str, list[str]]] = []
    for rate in rates:
        prompts = serve["kvfleet", rate]["num_prompts"]
        label = f"serve {rate} req/s ({prompts} requests)"
        runs = [serve[name, rate] for name in ENGINES]
        rows += [
            (f"{label}: achieved req/s", [f"{run['request_throughput']:.2f}" for run in runs]),
            (f"{label}: TTFT p50 / p99 (ms)", [_ms(run, "median_ttft_ms", "p99_ttft_ms") for run in runs]),
            (f"{label}: ITL p50 / p99 (ms)", [_ms(run, "median_itl_ms", "p99_itl_ms") for run in runs]),
            (f"{label}: TPOT p50 (ms)", [_ms(run, "median_tpot_ms") for run in runs]),
        ]
    offline = [engines[name]["offline"] for name in ENGINES]
    rows.append(
        (
            f"offline, {len(plan['offline'])} requests: output tokens/s",
            [f"{o['tokens_per_second']:.0f}" for o in offline],
        )
    )
    for batch in plan["decode"]["batch_sizes"]:
        step_ms = [engines[name]["decode_step_ms"][str(batch)] for name in ENGINES]
        rows.append((f"decode step, batch {batch} (ms)", [f"{ms:.2f}" for ms in step_ms]))

    loads = [line.split() for line in (results / "load.txt").read_text().splitlines() if line.strip()]
    kvfleet, vllm = engines["kvfleet"], engines["vllm"]
    lines = [
        SECTION_START,
        f"Measured {datetime.date.today().isoformat()} at commit {commit} on {os.cpu_count()} CPUs "
        f"({cpu_model()}): kvfleet with torch {kvfleet['torch']} ({kvfleet['threads']} threads), "
        f"vLLM {vllm['version']} with torch {vllm['torch']}. Load average (1 min) before each part: "
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
