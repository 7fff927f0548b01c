"""Printing benchmark results as the markdown tables docs/benchmarks.md records."""

from __future__ import annotations

import platform

import torch
from kvfleet.runtime.bench.throughput import PrefixResult, ThroughputResult


def machine_line() -> str:
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} threads"
    )
    return f"{platform.machine()} {device}, torch {torch.__version__}"


def print_throughput_report(results: list[ThroughputResult], prefix: list[PrefixResult]) -> None:
    kvfleet, *baselines = results
    best = max(baselines, key=lambda r: r.tokens_per_second)
    print(f"machine: {machine_line()}\n")
    print("| engine | seconds | output tokens | output tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for result in results:
        print(
            f"| {result.name} | {result.seconds:.1f} | {result.output_tokens} "
            f"| {result.tokens_per_second:.1f} |"
        )
    print(
        f"\nkvfleet / best transformers ({best.name}): "
        f"{kvfleet.tokens_per_second / best.tokens_per_second:.2f}x\n"
    )
    print("| shared-prefix workload | seconds | prefill tokens computed | prefix hit rate |")
    print("| --- | ---: | ---: | ---: |")
    for run in prefix:
        label = "prefix caching on" if run.prefix_caching else "prefix caching off"
        print(f"| {label} | {run.seconds:.1f} | {run.prefill_tokens_computed} | {run.hit_rate:.1%} |")
    on, off = (next(r for r in prefix if r.prefix_caching is flag) for flag in (True, False))
    if off.prefill_tokens_computed:
        saved = 1 - on.prefill_tokens_computed / off.prefill_tokens_computed
        print(f"\nprefill tokens saved by prefix caching: {saved:.1%}")
