"""Printing benchmark results as the markdown tables docs/benchmarks.md records."""

from __future__ import annotations

import platform

import torch
from kvfleet.runtime.bench.multi_turn import MultiTurnReport
from kvfleet.runtime.bench.structured import StructuredReport
from kvfleet.runtime.bench.throughput import ThroughputReport, ThroughputResult


def machine_line() -> str:
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} threads"
    )
    return f"{platform.machine()} {device}, torch {torch.__version__}"


def print_throughput_report(report: ThroughputReport) -> None:
    best = max(report.transformers, key=lambda r: r.tokens_per_second)
    print(f"machine: {machine_line()}\n")
    print("| engine | seconds | output tokens | output tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for result in [report.kvfleet, *report.transformers]:
        print(
            f"| {result.name} | {result.seconds:.1f} | {result.output_tokens} "
            f"| {result.tokens_per_second:.1f} |"
        )
    print(
        f"\nkvfleet / best transformers ({best.name}): "
        f"{report.kvfleet.tokens_per_second / best.tokens_per_second:.2f}x\n"
    )
    print("| shared-prefix workload | seconds | prefill tokens computed | prefix hit rate |")
    print("| --- | ---: | ---: | ---: |")
    for run in report.prefix_sharing:
        label = "prefix caching on" if run.prefix_caching else "prefix caching off"
        print(f"| {label} | {run.seconds:.1f} | {run.prefill_tokens_computed} | {run.hit_rate:.1%} |")
    on, off = (next(r for r in report.prefix_sharing if r.prefix_caching is flag) for flag in (True, False))
    if off.prefill_tokens_computed:
        saved = 1 - on.prefill_tokens_computed / off.prefill_tokens_computed
        print(f"\nprefill tokens saved by prefix caching: {saved:.1%}")
    cost = 1 - report.caching_on.tokens_per_second / report.caching_off.tokens_per_second
    print(
        f"\nworkloads like the main one (nothing shared; hit rate {report.caching_hit_rate:.1%}), "
        f"fastest of the rounds: prefix caching on {report.caching_on.tokens_per_second:.1f}, "
        f"off {report.caching_off.tokens_per_second:.1f} output tokens/s; "
        f"cost of prefix caching: {cost:.1%}"
    )


def _print_requests_table(results: list[ThroughputResult]) -> None:
    print(f"machine: {machine_line()}\n")
    print("| requests | seconds | output tokens | output tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for result in results:
        tokens_per_second = result.tokens_per_second
        print(f"| {result.name} | {result.seconds:.2f} | {result.output_tokens} | {tokens_per_second:.1f} |")


def print_structured_report(report: StructuredReport) -> None:
    print(f"machine: {machine_line()}; the fastest of {report.rounds} alternating rounds\n")
    print("| requests | seconds | CPU seconds | output tokens | output tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for result, cpu_seconds in (
        (report.constrained, report.constrained_cpu_seconds),
        (report.unconstrained, report.unconstrained_cpu_seconds),
    ):
        print(
            f"| {result.name} | {result.seconds:.2f} | {cpu_seconds:.2f} | {result.output_tokens} "
            f"| {result.tokens_per_second:.1f} |"
        )
    cost = 1 - report.constrained.tokens_per_second / report.unconstrained.tokens_per_second
    print(
        f"\ncost of the JSON-schema constraint: {cost:.1%} of the throughput; masks took "
        f"{report.mask_seconds_per_step * 1000:.2f} ms per step\n"
    )
    print("| schema | compile, cold (ms) | compile, cached (ms) |")
    print("| --- | ---: | ---: |")
    for entry in report.compile_times:
        print(f"| {entry.schema} | {entry.cold_seconds * 1000:.1f} | {entry.cached_seconds * 1000:.3f} |")


def print_lora_report(base: ThroughputResult, with_adapters: ThroughputResult) -> None:
    _print_requests_table([base, with_adapters])
    share = with_adapters.tokens_per_second / base.tokens_per_second
    print(f"\nwith adapters: {share:.1%} of the base model's throughput")


def print_multi_turn_report(report: MultiTurnReport) -> None:
    settings = report.settings
    cached, uncached = report.cached, report.uncached
    print(
        f"machine: {machine_line()}; {settings.num_users} users x {settings.num_turns} turns, system prompt "
        f"{settings.system_prompt_len}, messages {settings.user_message_len}, answers {settings.answer_len} "
        "tokens\n"
    )
    print(
        "| prefix caching | seconds | prompt tokens | prefill tokens computed | device cache hits | "
        "host tier hits |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, run in (("on", cached), ("off", uncached)):
        print(
            f"| {label} | {run.seconds:.1f} | {run.prompt_tokens} | {run.prefill_tokens_computed} | "
            f"{run.device_hit_tokens} | {run.host_hit_tokens} |"
        )
    print(f"\nprefill tokens saved by prefix caching: {report.prefill_saved:.1%}\n")
    print("| turn | median TTFT, caching on (ms) | median TTFT, caching off (ms) |")
    print("| ---: | ---: | ---: |")
    for turn in range(settings.num_turns):
        print(
            f"| {turn + 1} | {cached.median_ttft(turn) * 1e3:.0f} | {uncached.median_ttft(turn) * 1e3:.0f} |"
        )
    last = settings.num_turns - 1
    print(
        f"\nTTFT at turn {last + 1} / turn 1: {cached.median_ttft(last) / cached.median_ttft(0):.2f}x with "
        f"caching, {uncached.median_ttft(last) / uncached.median_ttft(0):.2f}x without"
    )
