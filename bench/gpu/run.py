"""kvfleet GPU benchmark: kernels checked and timed against the card's copy bandwidth, then end-to-end output
tokens/s of kvfleet against Transformers `generate`, and with two GPUs or more tensor parallel (TP=2 against
one GPU), written as a markdown section.

Runs from a clean checkout with the machine's own torch, Triton and Transformers (nothing installed):

    python3 bench/gpu/run.py --out results.md

`--smoke` runs the whole kernel section on the CPU through Triton's interpreter at toy sizes, to check the
script itself where no GPU is at hand. The process exits 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from checkout import ROOT, use_this_checkout

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="also write the markdown section to this file")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU through the interpreter")
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode tiling sweep")
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end section")
    parser.add_argument("--no-8b", action="store_true", help="end to end on the small model only")
    parser.add_argument("--no-tp", action="store_true", help="skip the tensor parallel section (2+ GPUs)")
    parser.add_argument("--requests", type=int, default=256, help="concurrent requests end to end")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--budget", type=float, default=450.0, help="seconds after which remaining sections are skipped"
    )
    return parser.parse_args()


class Clock:
    def __init__(self, budget: float) -> None:
        self.start = time.perf_counter()
        self.budget = budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def environment(device: Any) -> str:
    import torch
    import transformers
    import triton

    versions = (
        f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )
    if device.type != "cuda":
        return f"CPU (smoke run through the Triton interpreter); {versions}"
    props = torch.cuda.get_device_properties(device)
    return (
        f"{props.name}, compute capability {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB; {versions}"
    )


def kernel_section(args: argparse.Namespace, device: Any, clock: Clock) -> tuple[list[str], bool]:
    import kernel_bench
    import torch

    scale = kernel_bench.SMOKE if args.smoke else kernel_bench.Scale()
    measure = kernel_bench.timer(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    bandwidth = kernel_bench.copy_bandwidth(device, scale, measure)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    bench = kernel_bench.Bench(device, scale, measure, bandwidth, num_sms)
    rows, notes = kernel_bench.attention_rows(bench, sweep=not args.no_sweep and clock.left() > 300)
    log("attention done")
    rows += kernel_bench.fused_rows(bench)
    log("fused kernels done")
    rows += kernel_bench.lora_rows(bench)
    log("LoRA done")
    rows += kernel_bench.int8_rows(bench) + kernel_bench.moe_rows(bench)
    log("int8 and MoE done")
    lines = [
        f"Copy bandwidth (device-to-device `copy_`, bytes read + written, {scale.copy_bytes >> 20} MiB): "
        f"**{bandwidth / 1e12:.2f} TB/s**. Times are medians of `triton.testing.do_bench` (L2 flushed).",
        "",
        "| kernel | shape | time (us) | achieved | versus | check against torch |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    lines += [
        f"| {r.kernel} | {r.shape} | {r.microseconds:.1f} | {r.achieved} | {r.versus} | {r.check} |"
        for r in rows
    ]
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    return lines, all("FAIL" not in r.check for r in rows)


def run_child(command: list[str], timeout: float) -> dict[str, Any]:
    """One engine_bench.py process; its last stdout line is its JSON result."""
    log("running " + " ".join(command))
    result = subprocess.run(
        [sys.executable, str(HERE / "engine_bench.py"), *command],
        capture_output=True,
        text=True,
        timeout=max(timeout, 1.0),
        cwd=ROOT,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def agreement(first: list[list[int]], second: list[list[int]]) -> float:
    """Share of requests whose first greedy token is the same in both runs."""
    same = sum(a[:1] == b[:1] for a, b in zip(first, second, strict=True))
    return same / len(first)


def engine_section(args: argparse.Namespace, clock: Clock) -> list[str]:
    lines = [
        f"{args.requests} concurrent requests, {args.prompt_len} random prompt tokens and {args.output_len} "
        "greedy output tokens each (ignore_eos), bfloat16, one batch for Transformers.",
        "",
        "| model | kvfleet out tok/s | attention | Transformers out tok/s | speedup (target >= 10x) | "
        "first tokens agree |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    workload = [
        "--requests",
        str(args.requests),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
    ]
    models = [("small preset (Llama, 8 layers, hidden 512)", "make-small")]
    if not args.no_8b:
        models.append(("8B-shaped Llama (hidden 4096, 32 layers), random weights", "make-8b"))
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as scratch:
        for label, make in models:
            if clock.left() < 60:
                lines.append(f"| {label} | skipped: time budget spent | | | | |")
                continue
            folder = str(Path(scratch) / make)
            try:
                run_child([make, folder], clock.left())
                kvfleet = run_child(["kvfleet", folder, *workload], clock.left())
                hf = run_child(["transformers", folder, *workload], clock.left())
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                log(f"{label}: {exc}")
                lines.append(f"| {label} | failed: {str(exc).splitlines()[0][:120]} | | | | |")
                continue
            ours = kvfleet["output_tokens"] / kvfleet["seconds"]
            theirs = hf["output_tokens"] / hf["seconds"]
            agree = agreement(kvfleet["first_tokens"], hf["first_tokens"])
            lines.append(
                f"| {label} | {ours:,.0f} | {kvfleet['attention_backend']} | {theirs:,.0f} | "
                f"{ours / theirs:.1f}x | {100 * agree:.0f}% |"
            )
            log(lines[-1])
    return lines


def tensor_parallel_section(args: argparse.Namespace, clock: Clock) -> list[str]:
    """The small preset on one GPU and split over two (one worker process per GPU, NCCL): throughput, and
    whether the greedy first tokens agree with one GPU's."""
    import torch

    if torch.cuda.device_count() < 2:
        return [f"Skipped: tensor parallelism needs 2 GPUs, this machine has {torch.cuda.device_count()}."]
    lines = [
        f"Small preset, {args.requests} concurrent requests, {args.prompt_len} prompt and {args.output_len} "
        "output tokens each, bfloat16.",
        "",
        "| tensor_parallel_size | out tok/s | load s | first tokens agree with 1 GPU |",
        "| ---: | ---: | ---: | ---: |",
    ]
    workload = ["--requests", str(args.requests), "--prompt-len", str(args.prompt_len)]
    workload += ["--output-len", str(args.output_len)]
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-tp-") as scratch:
        folder = str(Path(scratch) / "small")
        try:
            run_child(["make-small", folder], clock.left())
            results = {
                tp: run_child(["kvfleet", folder, *workload, "--tensor-parallel-size", str(tp)], clock.left())
                for tp in (1, 2)
            }
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            log(f"tensor parallel: {exc}")
            return [f"Failed: {str(exc).splitlines()[0][:200]}"]
    for tp, result in results.items():
        agree = agreement(result["first_tokens"], results[1]["first_tokens"])
        lines.append(
            f"| {tp} | {result['output_tokens'] / result['seconds']:,.0f} | {result['load_seconds']:.1f} | "
            f"{100 * agree:.0f}% |"
        )
        log(lines[-1])
    return lines


def main() -> None:
    args = parse_args()
    if args.smoke:
        # Before any kernel module is imported: Triton picks interpreter or compiler per kernel definition.
        os.environ["TRITON_INTERPRET"] = "1"
    use_this_checkout()
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --smoke to check the script on the CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(0)
    clock = Clock(args.budget)
    today = datetime.date.today().isoformat()
    lines = [f"## Kernels and end to end, {today}", "", environment(device), ""]
    kernel_lines, checks_pass = kernel_section(args, device, clock)
    lines += ["### Kernels", "", *kernel_lines, ""]
    if not args.smoke and not args.no_engine:
        lines += ["### End to end", "", *engine_section(args, clock), ""]
    if not args.smoke and not args.no_tp:
        lines += ["### Tensor parallel", "", *tensor_parallel_section(args, clock), ""]
    lines.append(f"Whole run: {clock.elapsed():.0f} s.")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    sys.exit(0 if checks_pass else 1)


if __name__ == "__main__":
    main()
