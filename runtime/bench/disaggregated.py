"""`kvfleet bench disaggregated`: one mixed workload against a colocated replica, then against a prefill and a
decode replica behind the gateway, on the same CPUs.

The workload is what disaggregation is for: short chats that stream while long prompts (1-2K tokens, short
answers) keep arriving. A colocated replica runs each long prefill in the steps its decodes run in, chunked
or not, so every chat stalls while one is computed; with the roles apart, decodes run at their own pace and
the long prompts' KV blocks move from the prefill replica to the decode replica.

- colocated: one `kvfleet serve` with chunked prefill on all the CPUs given, called directly;
- disaggregated: a prefill replica (kv_producer) on half of them and a decode replica (kv_consumer) on the
  other half, and `kvfleet gateway` sending each prompt with enough new tokens to the prefill replica first.

Both runs send the same seeded requests at the same times. Reported side by side: TTFT and ITL of the chats
and of the long prompts, output tokens per second, failures; from the decode replica's metrics, the KV bytes
pulled per request that pulled and the transfer time per block. Model loading is outside every timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.runtime.bench.processes import MODEL_NAME, BenchProcess, ServeProcess, counter_totals
from kvfleet.runtime.bench.serve_client import ServeRequest, bench_client, send_workload
from kvfleet.runtime.bench.serve_report import MetricSelection, summarize
from kvfleet.runtime.bench.workloads import random_requests
from kvfleet.runtime.config import EngineConfig

# The decode replica's transfer counters (runtime/metrics.py), without their prefix and _total.
ITL_AND_TTFT = MetricSelection(("ttft", "itl"), (99.0,))
_TRANSFER_COUNTERS = (
    "kv_transfer_loads",
    "kv_transfer_blocks_pulled",
    "kv_transfer_bytes_pulled",
    "kv_transfer_pull_seconds",
)


@dataclass(frozen=True)
class MixSettings:
    """The mixed workload: Poisson arrivals of short chats and of long prompts over `seconds`."""

    seconds: float = 60.0
    chat_rate: float = 2.0
    chat_prompt_len: tuple[int, int] = (32, 128)
    chat_output_len: tuple[int, int] = (64, 128)
    # Enough long prompts that the chats' tokens they stall (one per chat in flight, each) are over 1% of all:
    # the p99 of inter-token latency sees them.
    long_rate: float = 0.5
    # Up to the `small` model's 2048 positions with their answers.
    long_prompt_len: tuple[int, int] = (1024, 2000)
    long_output_len: tuple[int, int] = (8, 16)
    seed: int = 0


def mixed_workload(settings: MixSettings, vocab_size: int) -> tuple[list[ServeRequest], list[str]]:
    """The requests in sending order and the kind of each ("chat" or "long"); all from the seed."""
    timed: list[tuple[float, str, ServeRequest]] = []
    for kind, rate, prompt_len, output_len in (
        ("chat", settings.chat_rate, settings.chat_prompt_len, settings.chat_output_len),
        ("long", settings.long_rate, settings.long_prompt_len, settings.long_output_len),
    ):
        rng = random.Random(f"{settings.seed}-{kind}")
        arrivals = []
        clock = rng.expovariate(rate)
        while clock < settings.seconds:
            arrivals.append(clock)
            clock += rng.expovariate(rate)
        prompts = random_requests(
            len(arrivals), prompt_len, output_len, vocab_size, seed=rng.randrange(1 << 30)
        )
        for send_at, prompt in zip(arrivals, prompts, strict=True):
            request = ServeRequest(prompt.prompt_token_ids, prompt.output_len, None, send_at)
            timed.append((send_at, kind, request))
    timed.sort(key=lambda item: item[0])
    return [request for _, _, request in timed], [kind for _, kind, _ in timed]


def run_disaggregated_bench(
    config: EngineConfig,
    settings: MixSettings,
    *,
    cpus: list[int],
    threshold_tokens: int,
    vocab_size: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Both runs, colocated first, on `cpus` (an even number of them; each role takes half); each run's
    summary by kind (see summarize)."""
    workload, kinds = mixed_workload(settings, vocab_size)
    report: dict[str, Any] = {"requests": dict.fromkeys(kinds, 0), "load_average": os.getloadavg()}
    for kind in kinds:
        report["requests"][kind] += 1
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-pd-") as temp:
        workdir = Path(temp)
        log(f"colocated: one replica on CPUs {cpus}")
        colocated = ServeProcess(
            config, workdir, [], log_name="colocated.log", env=_threads(len(cpus)), cpus=set(cpus)
        )
        report["colocated"] = _run(colocated.url, [colocated], workload, kinds)
        half = len(cpus) // 2
        log(f"disaggregated: a prefill replica on CPUs {cpus[:half]}, a decode replica on {cpus[half:]}")
        servers = _disaggregated_fleet(config, workdir, (cpus[:half], cpus[half:]), threshold_tokens)
        _, decode, gateway = servers
        report["disaggregated"] = _run(gateway.url, servers, workload, kinds, transfers_of=decode.url)
    report["load_average_after"] = os.getloadavg()
    return report


def _threads(count: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(count)}


def _disaggregated_fleet(
    config: EngineConfig, workdir: Path, role_cpus: tuple[list[int], list[int]], threshold_tokens: int
) -> list[BenchProcess]:
    """The prefill replica, the decode replica (each on its CPUs) and the gateway before them (on any CPU, as
    a pod of its own would be), not yet ready."""
    servers: list[BenchProcess] = []
    for role, cpus in zip(("kv_producer", "kv_consumer"), role_cpus, strict=True):
        transfer = {"kv_connector": "TcpConnector", "kv_role": role, "kv_port": 0}
        args = ["--kv-transfer-config", json.dumps(transfer)]
        servers.append(
            ServeProcess(
                config, workdir, args, log_name=f"{role}.log", env=_threads(len(cpus)), cpus=set(cpus)
            )
        )
    prefill, decode = servers
    gateway_args = ["gateway", "--model", MODEL_NAME, "--prefill", prefill.url, "--decode", decode.url]
    gateway_args += ["--pd-threshold-tokens", str(threshold_tokens)]
    servers.append(BenchProcess(gateway_args, workdir / "gateway.log", ready_path="/health"))
    return servers


def _run(
    url: str,
    processes: list[BenchProcess],
    workload: list[ServeRequest],
    kinds: list[str],
    transfers_of: str | None = None,
) -> dict[str, Any]:
    """The workload through `url`, once every process is ready, and what the replica at `transfers_of` pulled;
    stops them all whatever happens."""
    try:
        for process in processes:
            process.wait_ready()
        results, duration = asyncio.run(_send_all(url, workload))
        transfers = None if transfers_of is None else counter_totals([transfers_of], _TRANSFER_COUNTERS)
    finally:
        for process in reversed(processes):
            process.stop()
    for result, kind in zip(results, kinds, strict=True):
        result.tier = kind
    return {**summarize(results, duration, ITL_AND_TTFT), "transfers": transfers}


async def _send_all(url: str, workload: list[ServeRequest]) -> tuple[list, float]:
    async with bench_client(url, len(workload), timeout=600.0) as client:
        # One untimed request first: the first request of a process pays for lazy setup.
        await send_workload(client, MODEL_NAME, [ServeRequest([16, 17, 18, 19], 4, None, 0.0)])
        return await send_workload(client, MODEL_NAME, workload)


def format_report(report: dict[str, Any]) -> str:
    load, after = report["load_average"], report["load_average_after"]
    counts = ", ".join(f"{count} {kind}" for kind, count in report["requests"].items())
    lines = [
        f"{counts} requests; load average {load[0]:.2f} before, {after[0]:.2f} after",
        "",
        "| | chat ITL p50 ms | chat ITL p99 ms | chat TTFT p50 ms | long TTFT p50 ms | output tokens/s | "
        "failed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("colocated", "disaggregated"):
        run = report[name]
        chat, long = run["per_tier"]["chat"], run["per_tier"]["long"]
        lines.append(
            f"| {name} | {_ms(chat['median_itl_ms'])} | {_ms(chat['p99_itl_ms'])} | "
            f"{_ms(chat['median_ttft_ms'])} | {_ms(long['median_ttft_ms'])} | "
            f"{run['output_throughput']:.1f} | {run['failed']} |"
        )
    colocated, disaggregated = report["colocated"], report["disaggregated"]
    ratio = colocated["per_tier"]["chat"]["p99_itl_ms"] / disaggregated["per_tier"]["chat"]["p99_itl_ms"]
    lines += [
        "",
        f"chat ITL p99: {ratio:.2f}x lower disaggregated; TTFT p50 (all): "
        f"{disaggregated['median_ttft_ms'] / colocated['median_ttft_ms']:.2f}x; output tokens/s: "
        f"{disaggregated['output_throughput'] / colocated['output_throughput']:.2f}x",
    ]
    transfers = disaggregated["transfers"]
    loads, blocks = transfers["kv_transfer_loads"], transfers["kv_transfer_blocks_pulled"]
    if loads:
        lines.append(
            f"KV moved: {transfers['kv_transfer_bytes_pulled'] / loads / 2**20:.2f} MiB per request that "
            f"pulled ({loads:.0f} loads), {transfers['kv_transfer_pull_seconds'] / blocks * 1e3:.3f} ms per "
            "block"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
