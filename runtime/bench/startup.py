"""`kvfleet bench startup`: where a replica's start goes, cold, from prebuilt kernels, and warm.

Each run launches `kvfleet serve` on the model folder, polls /ready until it answers 200 (the time to Ready,
counted from the launch), sends a completion of one token (the time to first token, from the same launch),
reads the phases of the start from /metrics (`kvfleet:startup_phase_seconds`) and stops the server.

A cold run gets empty kernel caches (TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR): what a pod pays that finds no
kernels in its image or on a shared volume. A prebuilt run gets empty caches too, and the CPU operations
prebuilt for this CPU in a folder of their own (KVFLEET_PREBUILT_KERNELS), as the runtime image holds them.
Warm runs share caches that an unreported first run filled, as a node's shared cache would be. The operating
system's page cache is left alone (dropping it touches every process on the machine): the model's files and
Python's modules may be in memory for every kind, as they are on a node that ran the image before.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kvfleet.contract.metrics import PHASE_LABEL, STARTUP_PHASE_SECONDS
from kvfleet.runtime.bench.processes import MODEL_NAME, ServeProcess
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.kernels.cpu_build import PREBUILT_ENV_VAR, prebuild_cpu_ops
from kvfleet.runtime.kernels.cpu_features import cpu_target
from prometheus_client.parser import text_string_to_metric_families

KINDS = ("cold", "prebuilt", "warm")
_READY_POLL_S = 0.02
_REQUEST_TIMEOUT_S = 120.0


@dataclass
class StartupRun:
    kind: str
    ready_seconds: float
    first_token_seconds: float
    # By phase, as the server's processes timed them.
    phases: dict[str, float] = field(default_factory=dict)


def run_startup_bench(
    config: EngineConfig, kinds: tuple[str, ...], runs: int, log: Callable[[str], None]
) -> list[StartupRun]:
    """`runs` starts of each kind, one after the other."""
    results = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-startup-") as workdir:
        work = Path(workdir)
        warm_caches = _kernel_caches(work / "warm-caches")
        if "warm" in kinds:
            log("filling the warm kernel caches")
            _start(config, work, "fill", warm_caches)
        if "prebuilt" in kinds:
            log("building the CPU operations for this CPU's level")
            prebuild_cpu_ops(work / "prebuilt", [cpu_target()])
        for kind in kinds:
            for index in range(runs):
                env = warm_caches if kind == "warm" else _kernel_caches(work / f"{kind}-caches-{index}")
                if kind == "prebuilt":
                    env = env | {PREBUILT_ENV_VAR: str(work / "prebuilt")}
                run = _start(config, work, kind, env)
                log(f"{kind} {index + 1}/{runs}: Ready in {run.ready_seconds:.2f} s")
                results.append(run)
    return results


def _kernel_caches(folder: Path) -> dict[str, str]:
    return {
        "TORCH_EXTENSIONS_DIR": str(folder / "torch-extensions"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
    }


def _start(config: EngineConfig, workdir: Path, kind: str, caches: dict[str, str]) -> StartupRun:
    launched = time.monotonic()
    server = ServeProcess(config, workdir, [], log_name=f"{kind}.log", env=caches)
    try:
        server.wait_ready(poll_s=_READY_POLL_S)
        ready = time.monotonic() - launched
        answer = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1},
            timeout=_REQUEST_TIMEOUT_S,
        )
        answer.raise_for_status()
        first_token = time.monotonic() - launched
        metrics = httpx.get(f"{server.url}/metrics", timeout=_REQUEST_TIMEOUT_S).text
    finally:
        server.stop()
    return StartupRun(kind, ready, first_token, phases_from_metrics(metrics))


def phases_from_metrics(metrics_text: str) -> dict[str, float]:
    """The start's phases on a replica's /metrics page, by phase."""
    return {
        sample.labels[PHASE_LABEL]: sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == STARTUP_PHASE_SECONDS
        for sample in family.samples
    }


def format_startup_report(results: list[StartupRun]) -> str:
    """A Markdown table: the median seconds of each phase and of the time to Ready and to first token, by
    kind of start, with the range over the runs beside each."""
    kinds = [kind for kind in KINDS if any(run.kind == kind for run in results)]
    phases = list(dict.fromkeys(phase for run in results for phase in run.phases))
    rows: list[tuple[str, Callable[[StartupRun], float | None]]] = [
        *((phase, lambda run, phase=phase: run.phases.get(phase)) for phase in phases),
        ("**time to Ready**", lambda run: run.ready_seconds),
        ("**time to first token**", lambda run: run.first_token_seconds),
    ]
    lines = [
        "| seconds | " + " | ".join(f"{kind} (median, range)" for kind in kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for name, value in rows:
        cells = []
        for kind in kinds:
            values = [v for run in results if run.kind == kind and (v := value(run)) is not None]
            cells.append(
                f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})" if values else "–"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
