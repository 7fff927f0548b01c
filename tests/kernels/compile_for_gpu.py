"""Compile every kernel launch this package makes for an NVIDIA GPU, on a machine without one.

The real launchers run on small CPU tensors with each kernel replaced by a recorder; each recorded launch is
then compiled ahead of time with the argument specialization Triton's JIT would give it on a GPU, and the
PTX assembler reports registers and spills. One JSON line per launch on stdout. Run without
TRITON_INTERPRET (the kernels must be compilable functions): `python compile_for_gpu.py [capability]`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
from kvfleet.runtime.kernels import (
    activation,
    grouped_gemm,
    kv_cache_write,
    lora,
    paged_attention,
    rms_norm,
    rotary,
    triton_utils,
)
from kvfleet.runtime.kernels.paged_attention import build_tile_map, default_tiling
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

KERNELS = {
    paged_attention: ["_paged_attention_kernel", "_merge_splits_kernel"],
    kv_cache_write: ["_write_kv_cache_kernel"],
    rms_norm: ["_rms_norm_kernel"],
    rotary: ["_rotary_kernel"],
    activation: ["_silu_and_mul_kernel"],
    lora: ["_lora_shrink_kernel", "_lora_expand_kernel"],
    grouped_gemm: ["_grouped_gemm_kernel"],
}


class LaunchRecorder:
    def __init__(self, kernel: triton.JITFunction, launches: list) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append((self.kernel, args, kwargs))

        return record


def record_launches(calls: list[tuple[str, Callable[[], Any]]]) -> list[tuple[str, Any, tuple, dict]]:
    launches: list = []
    recorded: list[tuple[str, Any, tuple, dict]] = []
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, LaunchRecorder(getattr(module, name), launches))
        module.check_device = lambda *tensors: None  # the tensors stand in for CUDA ones
    for label, call in calls:
        start = len(launches)
        call()
        recorded.extend((label, *launch) for launch in launches[start:])
    return recorded


def compile_launch(kernel: triton.JITFunction, args: tuple, kwargs: dict, capability: int) -> dict[str, Any]:
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    values = dict(zip(kernel.arg_names, args, strict=False))
    values.update({name: value for name, value in kwargs.items() if name in kernel.arg_names})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int], Any] = {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if index in kernel.constexprs:
            kind, attr = "constexpr", None
        else:
            kind, attr = native_specialize_impl(type(backend), value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        elif attr:
            attrs[(index,)] = backend.parse_attr(attr)
    options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
    with tempfile.TemporaryDirectory() as scratch:
        ptx = Path(scratch) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
        report = subprocess.run(
            [triton.knobs.nvidia.ptxas.path, "-v", f"--gpu-name={arch}", str(ptx), "-o", str(ptx) + ".o"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return {"registers": registers, "spill_bytes": spills, "shared_bytes": compiled.metadata.shared}


def attention_call(
    *, dtype: torch.dtype, head_dim: int, queries_per_kv: int, max_query_len: int, num_splits: int = 1
) -> Callable[[], Any]:
    def call() -> Any:
        num_kv_heads, block_size, num_requests = 8, 16, 4
        num_tokens = max_query_len * num_requests
        query = torch.randn(num_tokens, num_kv_heads * queries_per_kv, head_dim, dtype=dtype)
        kv_cache = torch.randn(2, 64, block_size, num_kv_heads, head_dim, dtype=dtype)
        tiling = default_tiling(
            queries_per_kv=queries_per_kv, head_dim=head_dim, dtype=dtype, max_query_len=max_query_len
        )
        tiling = dataclasses.replace(tiling, num_splits=num_splits)
        starts = list(range(0, num_tokens + 1, max_query_len))
        return paged_attention.paged_attention(
            query,
            kv_cache,
            block_tables=torch.zeros(num_requests, 16, dtype=torch.int32),
            seq_lens=torch.full((num_requests,), 200, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            tile_map=build_tile_map(starts, tiling.block_q(queries_per_kv), torch.device("cpu")),
            tiling=tiling,
            scale=head_dim**-0.5,
        )

    return call


# (dtype, head_dim, queries_per_kv, max_query_len, num_splits) of the attention launches to compile.
ATTENTION_SHAPES = [
    (torch.bfloat16, 128, 8, 1, 1),
    (torch.bfloat16, 128, 4, 1, 4),
    (torch.bfloat16, 128, 4, 256, 1),
    (torch.float16, 64, 1, 64, 1),
    (torch.float32, 128, 4, 1, 1),
    (torch.bfloat16, 96, 8, 64, 1),
    (torch.bfloat16, 256, 2, 1, 1),
]


def launches_to_compile() -> list[tuple[str, Callable[[], Any]]]:
    bf16 = torch.bfloat16
    qkv = torch.randn(8, (32 + 16) * 128, dtype=bf16)
    query = qkv[:, : 32 * 128].view(8, 32, 128)
    key = qkv[:, 32 * 128 : 40 * 128].view(8, 8, 128)
    value = qkv[:, 40 * 128 :].view(8, 8, 128)
    kv_cache = torch.randn(2, 4, 16, 8, 128, dtype=bf16)
    hidden = torch.randn(8, 4096, dtype=bf16)
    weight = torch.ones(4096, dtype=bf16)
    calls: list[tuple[str, Callable[[], Any]]] = [
        (
            f"attention {dtype} d{head_dim} gqa{queries_per_kv} query {max_query_len} splits {num_splits}",
            attention_call(
                dtype=dtype,
                head_dim=head_dim,
                queries_per_kv=queries_per_kv,
                max_query_len=max_query_len,
                num_splits=num_splits,
            ),
        )
        for dtype, head_dim, queries_per_kv, max_query_len, num_splits in ATTENTION_SHAPES
    ]
    calls += [
        ("kv cache write bf16", lambda: kv_cache_write.write_kv_cache(key, value, kv_cache, torch.arange(8))),
        ("rms norm + residual bf16", lambda: rms_norm.rms_norm(hidden, weight, 1e-5, hidden.clone())),
        ("rms norm bf16", lambda: rms_norm.rms_norm(hidden, weight, 1e-5)),
        ("rotary bf16", lambda: rotary.rotary_embedding_(torch.arange(8), query, key, torch.randn(64, 128))),
        ("silu and mul bf16", lambda: activation.silu_and_mul(torch.randn(8, 2 * 14336, dtype=bf16))),
    ]
    # Qwen3-30B-A3B's experts (hidden 2048, expert width 768), four of its 128: a decode step's few rows per
    # expert through gate/up, a prefill chunk's many through down.
    calls += [
        (
            "grouped gemm gate/up decode bf16",
            lambda: grouped_gemm.grouped_gemm(
                torch.randn(8, 2048, dtype=bf16), torch.randn(4, 1536, 2048, dtype=bf16), [3, 1, 0, 4]
            ),
        ),
        (
            "grouped gemm down prefill bf16",
            lambda: grouped_gemm.grouped_gemm(
                torch.randn(512, 768, dtype=bf16), torch.randn(4, 2048, 768, dtype=bf16), [300, 200, 12, 0]
            ),
        ),
    ]
    calls += [
        (f"lora {label} bf16 rank 16", lora_call(token_slots, split_k))
        for label, token_slots, split_k in (
            ("decode, 4 adapters, split input", np.arange(64) % 4, 8),
            ("prefill", np.repeat(np.arange(4), 512), 1),
        )
    ]
    return calls


def lora_call(token_slots: np.ndarray, split_k: int) -> Callable[[], Any]:
    """An adapted q/k/v projection of Llama-3-8B's shape, four rank-16 slots."""

    def call() -> Any:
        bf16, slots, rank, slice_sizes = torch.bfloat16, 4, 16, [4096, 1024, 1024]
        x = torch.randn(len(token_slots), 4096, dtype=bf16)
        output = torch.randn(len(token_slots), sum(slice_sizes), dtype=bf16)
        lora_a = torch.randn(len(slice_sizes) * slots * rank, 4096, dtype=bf16)
        lora_b = torch.randn(sum(slice_sizes), slots * rank, dtype=bf16)
        plan = lora.plan_lora_tokens(token_slots, torch.device("cpu"))
        starts = torch.tensor([0, 4096, 5120, 6144], dtype=torch.int32)
        return lora.add_lora_(
            output, x, lora_a, lora_b, plan, slice_sizes, starts, rank=rank, split_k=split_k
        )

    return call


def main() -> None:
    if triton_utils.is_interpreting():
        sys.exit("unset TRITON_INTERPRET: the kernels must be compilable functions")
    capability = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    for label, kernel, args, kwargs in record_launches(launches_to_compile()):
        result = compile_launch(kernel, args, kwargs, capability)
        print(json.dumps({"launch": label, "kernel": kernel.__name__, "capability": capability, **result}))


if __name__ == "__main__":
    main()
