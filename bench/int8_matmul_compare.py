"""The CPU int8 matmul of this checkout against the same kernel built from another revision's source.

Both builds are loaded in one process (the other under a library name of its own) and run a Llama-family
model's projections, its LM head included, with random int8 weights of the shapes its config.json gives:
every projection of every layer in turn, so that no weight is read from cache twice in a row. For each row
count, the fastest of `--passes` passes over all of them, three rounds alternating the two builds; ms per
pass and the ratio. Run it from the checkout with the project's environment:

    python bench/int8_matmul_compare.py --model DIR --before HEAD~1 [--rows 1,8] [--group-size 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvfleet.runtime.kernels.cpu_build import LINK_FLAGS, compile_flags
from kvfleet.runtime.kernels.cpu_features import cpu_target
from kvfleet.runtime.quantization.linear import feature_block, int8_ops_available, pack_feature_blocks
from torch.utils import cpp_extension

SOURCE = "runtime/kernels/cpu_quant.cpp"
LIBRARY = "kvfleet_cpu_quant"
# Builds from before the kernel said its width packed every block eight features wide.
EARLIER_WIDTH = 8

Projection = tuple[torch.Tensor, torch.Tensor]  # packed weight, packed scales


def build_before(revision: str, folder: Path) -> tuple[Callable, int]:
    """The kernel of `revision`, built for this CPU as the runtime builds its own, and its block width."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{SOURCE}"], capture_output=True, text=True, check=True
    ).stdout
    renamed = f"{LIBRARY}_before"
    path = folder / f"{renamed}.cpp"
    path.write_text(source.replace(LIBRARY, renamed))
    cpp_extension.load(
        name=renamed,
        sources=[str(path)],
        extra_cflags=compile_flags(cpu_target()),
        extra_ldflags=list(LINK_FLAGS),
        build_directory=str(folder),
        is_python_module=False,
    )
    ops = getattr(torch.ops, renamed)
    width = ops.feature_block() if hasattr(ops, "feature_block") else EARLIER_WIDTH
    return ops.int8_linear, width


def projection_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of each projection of each layer, then the LM head."""
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    layer = [
        (q_size + 2 * kv_size, hidden),
        (hidden, q_size),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def fastest_pass(
    kernel: Callable, projections: list[Projection], inputs: list[torch.Tensor], passes: int
) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for (weight, scale), x in zip(projections, inputs, strict=True):
            kernel(x, weight, scale, None)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="a model folder (its config.json)")
    parser.add_argument("--before", required=True, help="the git revision whose kernel is compared")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--group-size", type=int, default=0, help="input columns per scale; 0: one per row")
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args()
    if not int8_ops_available():
        raise SystemExit("this checkout's C++ int8 matmul cannot be built here")
    shapes = projection_shapes(json.loads((args.model / "config.json").read_text()))
    generator = torch.Generator().manual_seed(0)
    weights = []
    for out, columns in shapes:
        groups = 1 if args.group_size == 0 else columns // args.group_size
        weight = torch.randint(-127, 128, (out, columns), dtype=torch.int8, generator=generator)
        weights.append((weight, torch.rand(out, groups, generator=generator) / 100))
    with tempfile.TemporaryDirectory() as folder:
        before, before_width = build_before(args.before, Path(folder))
        kernels = {
            "before": (before, before_width),
            "now": (torch.ops.kvfleet_cpu_quant.int8_linear, feature_block()),
        }
        packed = {
            name: [(pack_feature_blocks(w, width), pack_feature_blocks(s, width)) for w, s in weights]
            for name, (_, width) in kernels.items()
        }
        print(
            f"{len(shapes)} projections, {sum(o * i for o, i in shapes) / 1e6:.1f} M int8 weights; widths "
            f"{before_width} before, {feature_block()} now; {torch.get_num_threads()} threads, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        print("| rows | before (ms) | now (ms) | now against before |\n| ---: | ---: | ---: | ---: |")
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = [torch.randn(rows, columns, generator=generator) for _, columns in shapes]
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(3):
                for name, (kernel, _) in kernels.items():
                    best[name] = min(best[name], fastest_pass(kernel, packed[name], inputs, args.passes))
            before_ms, now_ms = best["before"] * 1e3, best["now"] * 1e3
            print(f"| {rows} | {before_ms:.3f} | {now_ms:.3f} | {before_ms / now_ms:.2f}x |")


if __name__ == "__main__":
    main()
