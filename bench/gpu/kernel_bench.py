"""Kernel section of the GPU benchmark: each kernel checked against its torch reference on the device, then
timed (median, L2 flushed between runs) and its achieved bandwidth or FLOP rate compared with the card's
measured copy bandwidth or with the torch path it replaces.

`Scale` holds every shape, so that `--smoke` can run the same code on the CPU (through Triton's
interpreter) at toy sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from kvfleet.runtime.attention.backend import AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend
from kvfleet.runtime.attention.triton_backend import TritonAttentionBackend
from kvfleet.runtime.kernels import torch_reference
from kvfleet.runtime.kernels.activation import silu_and_mul
from kvfleet.runtime.kernels.grouped_gemm import grouped_gemm
from kvfleet.runtime.kernels.int8_matmul import int8_matmul
from kvfleet.runtime.kernels.kv_cache_write import write_kv_cache
from kvfleet.runtime.kernels.lora import plan_lora_tokens
from kvfleet.runtime.kernels.paged_attention import (
    AttentionTiling,
    build_tile_map,
    choose_num_splits,
    default_tiling,
    paged_attention,
)
from kvfleet.runtime.kernels.rms_norm import rms_norm
from kvfleet.runtime.kernels.rotary import rotary_embedding_
from kvfleet.runtime.kernels.triton_utils import is_interpreting
from kvfleet.runtime.lora.layers import LoRABatch, LoRALinear
from kvfleet.runtime.models import layers
from kvfleet.runtime.models.moe import GroupedLinear
from kvfleet.runtime.quantization.linear import dequantize

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Scale:
    decode_batch: int = 64
    decode_context: int = 4096
    long_batch: int = 2
    long_context: int = 32768
    prefill_batch: int = 4
    prefill_len: int = 2048
    mixed_decodes: int = 63
    mixed_context: int = 2048
    mixed_chunk: int = 512
    num_heads: int = 64  # decode shape: 8 query heads per KV head
    num_kv_heads: int = 8
    llama_heads: int = 32  # Llama-3-8B attention and MLP shapes for prefill and the fused ops
    llama_kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    intermediate: int = 14336
    tokens: int = 8192
    block_size: int = 16
    copy_bytes: int = 2 << 30
    check_requests: int = 8  # requests of a batch compared against the float64 reference
    quant_group: int = 128  # input columns per scale in the grouped int8 weights
    experts: int = 8  # Mixtral-8x7B's experts and their MLP shapes (hidden, intermediate above)
    experts_per_token: int = 2


SMOKE = Scale(
    decode_batch=3,
    decode_context=40,
    long_batch=1,
    long_context=600,
    prefill_batch=2,
    prefill_len=24,
    mixed_decodes=2,
    mixed_context=30,
    mixed_chunk=9,
    num_heads=8,
    num_kv_heads=1,
    llama_heads=4,
    llama_kv_heads=2,
    head_dim=64,
    hidden=128,
    intermediate=160,
    tokens=16,
    copy_bytes=1 << 20,
    check_requests=2,
    quant_group=32,
    experts=4,
)


@dataclass
class Row:
    kernel: str
    shape: str
    microseconds: float
    achieved: str
    versus: str
    check: str


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median seconds of fn: CUDA-event timing with an L2 flush on the GPU, wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def wall(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    return wall


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def tolerance(dtype: torch.dtype) -> float:
    # Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest: twice the error.
    return TOLERANCE[dtype] * (2 if dtype == torch.bfloat16 and is_interpreting() else 1)


def check_result(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if actual.isnan().any():
        return "FAIL (NaN)"
    error = max_relative_error(actual, expected)
    verdict = "ok" if error <= tolerance(actual.dtype) else "FAIL"
    return f"{verdict} ({error:.1e})"


def copy_bandwidth(device: torch.device, scale: Scale, measure: Callable) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read plus bytes written."""
    source = torch.empty(scale.copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    seconds = measure(lambda: target.copy_(source))
    return 2 * scale.copy_bytes / seconds


@dataclass
class PagedStep:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata

    def context_bytes(self) -> int:
        """K and V bytes attention must read: every request's whole context."""
        per_token = 2 * self.kv_cache.shape[3] * self.kv_cache.shape[4] * self.kv_cache.element_size()
        return sum(self.metadata.seq_lens_cpu) * per_token


def paged_step(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedStep:
    """Random step of (cached, new) tokens per request over shuffled blocks, with every context's K/V (the
    new tokens' included) already in the cache."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in requests]
    blocks = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=generator)
    block_tables = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for row, ((cached, new), count) in enumerate(zip(requests, blocks, strict=True)):
        table = order[first : first + count]
        block_tables[row, :count] = table.to(torch.int32)
        positions = torch.arange(cached, cached + new)
        slots.append(table[positions // block_size] * block_size + positions % block_size)
        first += count
    starts = [0]
    for _, new in requests:
        starts.append(starts[-1] + new)
    kv_cache = torch.randn((2, sum(blocks), block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(new for _, new in requests),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    num_tokens = starts[-1]

    def random(heads: int) -> torch.Tensor:
        return torch.randn((num_tokens, heads, head_dim), dtype=dtype, device=device)

    return PagedStep(random(num_heads), random(num_kv_heads), random(num_kv_heads), kv_cache, metadata)


def run_attention(step: PagedStep, tiling: AttentionTiling) -> Callable[[], torch.Tensor]:
    queries_per_kv = step.query.shape[1] // step.kv_cache.shape[3]
    metadata = step.metadata
    tile_map = build_tile_map(metadata.query_start_loc_cpu, tiling.block_q(queries_per_kv), step.query.device)
    out = torch.empty_like(step.query)

    def call() -> torch.Tensor:
        return paged_attention(
            step.query,
            step.kv_cache,
            block_tables=metadata.block_tables,
            seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc,
            tile_map=tile_map,
            tiling=tiling,
            scale=step.query.shape[2] ** -0.5,
            out=out,
        )

    return call


def check_attention(step: PagedStep, out: torch.Tensor, num_requests: int) -> str:
    """Compare the first `num_requests` requests' rows with the float64 reference."""
    metadata = step.metadata
    end = metadata.query_start_loc_cpu[num_requests]
    expected = torch_reference.paged_attention(
        step.query[:end],
        step.kv_cache,
        block_tables=metadata.block_tables[:num_requests],
        seq_lens=metadata.seq_lens[:num_requests],
        query_start_loc=metadata.query_start_loc[: num_requests + 1],
        scale=step.query.shape[2] ** -0.5,
    )
    return check_result(out[:end], expected)


def step_tiling(step: PagedStep, num_sms: int) -> AttentionTiling:
    """The tiling the Triton backend would use for this step on this device."""
    num_heads, head_dim = step.query.shape[1:]
    queries_per_kv = num_heads // step.kv_cache.shape[3]
    metadata = step.metadata
    tiling = default_tiling(
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        dtype=step.query.dtype,
        max_query_len=metadata.max_query_len,
    )
    if metadata.max_query_len == 1 and num_sms:
        num_tiles = len(metadata.seq_lens_cpu)
        programs = num_tiles * step.kv_cache.shape[3]
        splits = choose_num_splits(programs, metadata.max_seq_len, tiling.block_n, num_sms)
        tiling = dataclasses.replace(tiling, num_splits=splits)
    return tiling


DECODE_SWEEP = [
    AttentionTiling(16, block_n, num_splits, num_warps, num_stages)
    for block_n in (32, 64, 128)
    for num_warps in (4, 8)
    for num_stages in (2, 3, 4)
    for num_splits in (1, 2)
    if not (block_n == 128 and num_stages == 4)
]


@dataclass
class Bench:
    """What every measurement needs: where, at which sizes, with which timer, against which ceiling."""

    device: torch.device
    scale: Scale
    measure: Callable[[Callable[[], object]], float]
    bandwidth: float
    num_sms: int
    dtype: torch.dtype = torch.bfloat16

    def step(self, requests: list[tuple[int, int]], *, llama: bool) -> PagedStep:
        scale = self.scale
        return paged_step(
            requests,
            num_heads=scale.llama_heads if llama else scale.num_heads,
            num_kv_heads=scale.llama_kv_heads if llama else scale.num_kv_heads,
            head_dim=scale.head_dim,
            block_size=scale.block_size,
            dtype=self.dtype,
            device=self.device,
        )

    def spec(self, step: PagedStep) -> AttentionSpec:
        num_heads, head_dim = step.query.shape[1:]
        num_kv_heads = step.kv_cache.shape[3]
        return AttentionSpec(
            num_heads, num_kv_heads, head_dim, self.scale.block_size, self.dtype, self.device
        )

    def percent_of_copy(self, bytes_per_second: float) -> str:
        return f"{100 * bytes_per_second / self.bandwidth:.0f}% of copy"


def backend_seconds(bench: Bench, backend_class: type, step: PagedStep) -> float:
    backend = backend_class(bench.spec(step))
    if isinstance(backend, TritonAttentionBackend):
        backend.num_sms = bench.num_sms
    plan = backend.prepare(step.metadata)
    return bench.measure(lambda: backend.forward(step.query, step.key, step.value, step.kv_cache, plan))


def decode_rows(bench: Bench, sweep: bool) -> tuple[list[Row], list[str]]:
    scale = bench.scale
    step = bench.step([(scale.decode_context - 1, 1)] * scale.decode_batch, llama=False)
    shape = (
        f"batch {scale.decode_batch}, context {scale.decode_context}, {scale.num_heads}/{scale.num_kv_heads} "
        f"heads x {scale.head_dim}, bf16"
    )
    tiling = step_tiling(step, bench.num_sms)
    call = run_attention(step, tiling)
    check = check_attention(step, call(), min(scale.check_requests, scale.decode_batch))
    seconds = bench.measure(call)
    rate = step.context_bytes() / seconds
    versus = f"{bench.percent_of_copy(rate)} (target >= 70%)"
    rows = [Row("paged attention, decode", shape, seconds * 1e6, f"{rate / 1e12:.2f} TB/s", versus, check)]
    triton_seconds = backend_seconds(bench, TritonAttentionBackend, step)
    sdpa_seconds = backend_seconds(bench, SdpaAttentionBackend, step)
    rows.append(
        Row(
            "attention backend forward (KV write + attention), decode",
            shape,
            triton_seconds * 1e6,
            f"sdpa backend {sdpa_seconds * 1e6:.1f} us",
            f"{sdpa_seconds / triton_seconds:.1f}x sdpa",
            "-",
        )
    )
    notes: list[str] = []
    if sweep:
        notes = sweep_decode_tilings(bench, step, tiling)
    return rows, notes


def sweep_decode_tilings(bench: Bench, step: PagedStep, default: AttentionTiling) -> list[str]:
    notes, results = [], []
    for candidate in DECODE_SWEEP:
        try:
            results.append((bench.measure(run_attention(step, candidate)), candidate))
        except Exception as exc:  # a tiling the device cannot hold (shared memory) is just skipped
            notes.append(f"decode tiling {candidate} failed: {type(exc).__name__}: {exc}"[:200])
    results.sort(key=lambda item: item[0])
    for seconds, candidate in results[:5]:
        rate = step.context_bytes() / seconds
        notes.append(
            f"decode tiling block_n={candidate.block_n} warps={candidate.num_warps} "
            f"stages={candidate.num_stages} splits={candidate.num_splits}: {seconds * 1e6:.1f} us, "
            f"{rate / 1e12:.2f} TB/s ({bench.percent_of_copy(rate)})"
        )
    if results:
        best = results[0][1]
        best_check = check_attention(step, run_attention(step, best)(), bench.scale.check_requests)
        notes.append(f"best decode tiling {best} checks {best_check}; default is {default}")
    return notes


def long_context_rows(bench: Bench) -> list[Row]:
    scale = bench.scale
    step = bench.step([(scale.long_context - 1, 1)] * scale.long_batch, llama=False)
    # On the CPU there is no multiprocessor count; split as an H100/H200 (132 SMs) would.
    split = step_tiling(step, bench.num_sms or 132)
    split_call = run_attention(step, split)
    check = check_attention(step, split_call(), scale.long_batch)
    split_seconds = bench.measure(split_call)
    unsplit_seconds = bench.measure(run_attention(step, dataclasses.replace(split, num_splits=1)))
    rate = step.context_bytes() / split_seconds
    return [
        Row(
            f"paged attention, split-KV decode ({split.num_splits} splits)",
            f"batch {scale.long_batch}, context {scale.long_context}, same heads",
            split_seconds * 1e6,
            f"{rate / 1e12:.2f} TB/s",
            f"{unsplit_seconds / split_seconds:.1f}x unsplit; {bench.percent_of_copy(rate)}",
            check,
        )
    ]


def prefill_rows(bench: Bench) -> list[Row]:
    scale = bench.scale
    batch, length, heads, kv_heads = (
        scale.prefill_batch,
        scale.prefill_len,
        scale.llama_heads,
        scale.llama_kv_heads,
    )
    step = bench.step([(0, length)] * batch, llama=True)
    call = run_attention(step, step_tiling(step, bench.num_sms))
    check = check_attention(step, call(), min(2, batch))
    seconds = bench.measure(call)
    causal_flops = 4 * batch * heads * scale.head_dim * length**2 / 2
    q = step.query.view(batch, length, heads, scale.head_dim).transpose(1, 2)
    k = step.key.view(batch, length, kv_heads, scale.head_dim).transpose(1, 2)
    v = step.value.view(batch, length, kv_heads, scale.head_dim).transpose(1, 2)
    dense_seconds = bench.measure(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    return [
        Row(
            "paged attention, prefill",
            f"{batch} x {length} new tokens, {heads}/{kv_heads} heads",
            seconds * 1e6,
            f"{causal_flops / seconds / 1e12:.0f} TFLOP/s",
            f"torch SDPA (dense, unpaged) {causal_flops / dense_seconds / 1e12:.0f} TFLOP/s",
            check,
        )
    ]


def mixed_rows(bench: Bench) -> list[Row]:
    scale = bench.scale
    chunk, context, decodes = scale.mixed_chunk, scale.mixed_context, scale.mixed_decodes
    step = bench.step([(context - chunk, chunk)] + [(context - 1, 1)] * decodes, llama=True)
    call = run_attention(step, step_tiling(step, bench.num_sms))
    check = check_attention(step, call(), min(scale.check_requests, decodes + 1))
    seconds = bench.measure(call)
    sdpa_seconds = backend_seconds(bench, SdpaAttentionBackend, step)
    triton_seconds = backend_seconds(bench, TritonAttentionBackend, step)
    return [
        Row(
            "paged attention, mixed step",
            f"{chunk}-token chunk over {context - chunk} cached + {decodes} decodes at {context}",
            seconds * 1e6,
            f"{step.context_bytes() / seconds / 1e12:.2f} TB/s of context",
            f"backend forward {sdpa_seconds / triton_seconds:.1f}x sdpa",
            check,
        )
    ]


def attention_rows(bench: Bench, sweep: bool) -> tuple[list[Row], list[str]]:
    rows, notes = decode_rows(bench, sweep)
    rows += long_context_rows(bench)
    rows += prefill_rows(bench)
    rows += mixed_rows(bench)
    return rows, notes


def fused_rows(bench: Bench) -> list[Row]:
    device, scale, measure, dtype = bench.device, bench.scale, bench.measure, bench.dtype
    tokens, hidden = scale.tokens, scale.hidden
    rows: list[Row] = []

    def row(name: str, shape: str, seconds: float, moved: int, torch_seconds: float, check: str) -> None:
        rate = moved / seconds
        rows.append(
            Row(
                name,
                shape,
                seconds * 1e6,
                f"{rate / 1e12:.2f} TB/s ({bench.percent_of_copy(rate)})",
                f"{torch_seconds / seconds:.1f}x torch",
                check,
            )
        )

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    norm = layers.RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    weight = norm.weight.detach()
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_residual = norm.forward_native(x, residual)
    residual_check = (
        "exact"
        if torch.equal(new_residual, expected_residual)
        else check_result(new_residual, expected_residual)
    )
    check = f"{check_result(out, expected_out)} / residual {residual_check}"
    row(
        "fused add + RMSNorm",
        f"{tokens} x {hidden}, bf16",
        measure(lambda: rms_norm(x, weight, 1e-5, residual)),
        4 * x.numel() * x.element_size(),
        measure(lambda: norm.forward_native(x, residual)),
        check,
    )

    heads, kv_heads, head_dim = scale.llama_heads, scale.llama_kv_heads, scale.head_dim
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    rotary = layers.RotaryEmbedding(head_dim, 8192, {"rope_theta": 500000.0}).to(device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    expected_query, expected_key = query.clone(), key.clone()
    torch_reference.rotary_embedding_(positions, expected_query, expected_key, rotary.cos_sin_cache)
    work_query, work_key = query.clone(), key.clone()
    rotary_embedding_(positions, work_query, work_key, rotary.cos_sin_cache)
    check = check_result(work_query, expected_query) + " / " + check_result(work_key, expected_key)

    # Once per step in the model, shared by every layer.
    cos, signed_sin = rotary.prepare(positions, dtype).cos_sin

    def torch_rotary() -> None:
        layers.RotaryEmbedding.rotate_(query, cos, signed_sin)
        layers.RotaryEmbedding.rotate_(key, cos, signed_sin)

    moved = 2 * (query.numel() + key.numel()) * query.element_size() + tokens * head_dim * 4
    row(
        "rotary embedding, in place",
        f"{tokens} tokens, {heads}/{kv_heads} heads x {head_dim}",
        measure(lambda: rotary_embedding_(positions, query, key, rotary.cos_sin_cache)),
        moved,
        measure(torch_rotary),
        check,
    )

    gate_up = torch.randn(tokens, 2 * scale.intermediate, dtype=dtype, device=device)
    activation = layers.SiluAndMul()
    check = check_result(silu_and_mul(gate_up), torch_reference.silu_and_mul(gate_up.double()))
    row(
        "SiLU and mul",
        f"{tokens} x 2 x {scale.intermediate}",
        measure(lambda: silu_and_mul(gate_up)),
        3 * tokens * scale.intermediate * gate_up.element_size(),
        measure(lambda: activation.forward_native(gate_up)),
        check,
    )

    num_blocks = math.ceil(tokens / scale.block_size) * 2
    kv_cache = torch.zeros(2, num_blocks, scale.block_size, kv_heads, head_dim, dtype=dtype, device=device)
    expected_cache = kv_cache.clone()
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * scale.block_size, device=device)[:tokens]
    write_kv_cache(key, value, kv_cache, slots)
    torch_reference.write_kv_cache(key, value, expected_cache, slots)
    check = "ok (exact)" if torch.equal(kv_cache, expected_cache) else "FAIL"
    row(
        "KV cache write",
        f"{tokens} tokens, {kv_heads} heads x {head_dim}",
        measure(lambda: write_kv_cache(key, value, kv_cache, slots)),
        4 * key.numel() * key.element_size(),
        measure(lambda: torch_reference.write_kv_cache(key, value, expected_cache, slots)),
        check,
    )
    return rows


LORA_ADAPTERS = 4
LORA_RANK = 16


def lora_rows(bench: Bench) -> list[Row]:
    """The batched LoRA update of an adapted q/k/v projection, tokens spread over four rank-16 adapters,
    against the dense torch path the CPU runs; checked against that path in float64."""
    scale, device, dtype = bench.scale, bench.device, bench.dtype
    q_size = scale.llama_heads * scale.head_dim
    kv_size = scale.llama_kv_heads * scale.head_dim
    slice_sizes = [q_size, kv_size, kv_size]
    base = layers.Linear(scale.hidden, sum(slice_sizes), bias=False)
    generator = torch.Generator().manual_seed(4)
    slot_a = [torch.randn(3 * LORA_RANK, scale.hidden, generator=generator) / 8 for _ in range(LORA_ADAPTERS)]
    slot_b = [torch.randn(sum(slice_sizes), LORA_RANK, generator=generator) / 8 for _ in range(LORA_ADAPTERS)]

    def layer(layer_dtype: torch.dtype, use_triton: bool) -> LoRALinear:
        module = LoRALinear(
            base,
            slice_sizes,
            LoRABatch(),
            max_loras=LORA_ADAPTERS,
            max_rank=LORA_RANK,
            dtype=layer_dtype,
            device=device,
            use_triton=use_triton,
        )
        for slot in range(LORA_ADAPTERS):
            module.set_slot(slot, slot_a[slot].to(dtype), slot_b[slot].to(dtype))
        return module

    kernel_layer, dense_layer, reference = (
        layer(dtype, True),
        layer(dtype, False),
        layer(torch.float64, False),
    )
    rows = []
    for label, num_tokens in (("decode", scale.decode_batch), ("prefill", scale.tokens)):
        token_slots = np.arange(num_tokens) % LORA_ADAPTERS
        slots = torch.from_numpy(token_slots).to(device)[:, None]
        slot_of_column = torch.arange(LORA_ADAPTERS * LORA_RANK, device=device) // LORA_RANK
        kernel_layer.batch.plan = plan_lora_tokens(token_slots, device)
        dense_layer.batch.other_columns = reference.batch.other_columns = slot_of_column != slots
        x = torch.randn(num_tokens, scale.hidden, dtype=dtype, device=device)
        output = torch.randn(num_tokens, sum(slice_sizes), dtype=dtype, device=device)
        result = output.clone()
        kernel_layer.add_lora(x, result)
        expected = output.double()
        reference.add_lora(x.double(), expected)
        check = check_result(result, expected)
        seconds = bench.measure(functools.partial(kernel_layer.add_lora, x, output))
        dense_seconds = bench.measure(functools.partial(dense_layer.add_lora, x, output))
        # Each adapter's A and B read once, the activations read once and the output read and written.
        moved = (
            LORA_ADAPTERS * (slot_a[0].numel() + slot_b[0].numel()) + x.numel() + 2 * output.numel()
        ) * x.element_size()
        rate = moved / seconds
        rows.append(
            Row(
                f"batched LoRA, {label}",
                f"{num_tokens} tokens over {LORA_ADAPTERS} adapters of rank {LORA_RANK}, "
                f"{scale.hidden} -> {q_size}+{kv_size}+{kv_size}",
                seconds * 1e6,
                f"{rate / 1e12:.2f} TB/s ({bench.percent_of_copy(rate)})",
                f"{dense_seconds / seconds:.1f}x torch (dense)",
                check,
            )
        )
    return rows


def bandwidth_row(
    bench: Bench, kernel: str, shape: str, seconds: float, moved: int, versus: str, check: str
) -> Row:
    rate = moved / seconds
    achieved = f"{rate / 1e12:.2f} TB/s ({bench.percent_of_copy(rate)})"
    return Row(kernel, shape, seconds * 1e6, achieved, versus, check)


def flops_row(
    bench: Bench, kernel: str, shape: str, seconds: float, flops: int, versus: str, check: str
) -> Row:
    return Row(kernel, shape, seconds * 1e6, f"{flops / seconds / 1e12:.0f} TFLOP/s", versus, check)


def int8_rows(bench: Bench) -> list[Row]:
    """Weight-only int8 on Llama-3-8B's gate and up projection (hidden -> 2 x intermediate), per-channel and
    grouped scales, against the bf16 projection it replaces (cuBLAS on a bf16 weight); checked against
    float64. Decode rows are bound by the weight's bytes, the prefill row by arithmetic."""
    scale, device, dtype = bench.scale, bench.device, bench.dtype
    in_features, out_features = scale.hidden, 2 * scale.intermediate
    generator = torch.Generator(device=device).manual_seed(5)
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device)
    rows = []
    for groups in (1, in_features // scale.quant_group):
        weight_scale = torch.rand(out_features, groups, generator=generator, device=device) / 2048
        float_weight = dequantize(weight, weight_scale, dtype)
        exact_weight = dequantize(weight, weight_scale, torch.float64)
        scales = "per channel" if groups == 1 else f"groups of {in_features // groups}"
        for tokens in (1, scale.decode_batch, scale.tokens):
            x = torch.randn(tokens, in_features, generator=generator, device=device).to(dtype)
            check = check_result(int8_matmul(x, weight, weight_scale, None), x.double() @ exact_weight.T)
            seconds = bench.measure(functools.partial(int8_matmul, x, weight, weight_scale, None))
            dense_seconds = bench.measure(functools.partial(torch.nn.functional.linear, x, float_weight))
            shape = f"{tokens} x {in_features} -> {out_features}, {scales}"
            versus = f"{dense_seconds / seconds:.2f}x bf16 weight"
            if tokens == scale.tokens:
                flops = 2 * tokens * in_features * out_features
                rows.append(
                    flops_row(bench, "int8 weight matmul, prefill", shape, seconds, flops, versus, check)
                )
                continue
            # The int8 weight and its scales once, the activations in and the output out.
            moved = weight.numel() + 4 * weight_scale.numel()
            moved += (x.numel() + tokens * out_features) * x.element_size()
            rows.append(
                bandwidth_row(bench, "int8 weight matmul, decode", shape, seconds, moved, versus, check)
            )
    return rows


def moe_rows(bench: Bench) -> list[Row]:
    """The grouped GEMM of a mixture-of-experts layer (Mixtral-8x7B's gate and up projections), tokens
    routed to their top experts at random, against the matmul per expert it replaces; checked against
    float64."""
    scale, device, dtype = bench.scale, bench.device, bench.dtype
    in_features, out_features = scale.hidden, 2 * scale.intermediate
    generator = torch.Generator(device=device).manual_seed(6)
    weight = (
        torch.randn(scale.experts, out_features, in_features, generator=generator, device=device) / 64
    ).to(dtype)
    per_expert = GroupedLinear()
    rows = []
    for label, tokens in (("decode", scale.decode_batch), ("prefill", scale.tokens)):
        choices = torch.rand(tokens, scale.experts, generator=generator, device=device)
        experts = choices.topk(scale.experts_per_token, dim=-1).indices.flatten()
        sizes = torch.bincount(experts, minlength=scale.experts).tolist()
        x = torch.randn(len(experts), in_features, generator=generator, device=device).to(dtype)
        expected = torch.cat(
            [rows_of.double() @ w.double().T for rows_of, w in zip(x.split(sizes), weight, strict=True)]
        )
        check = check_result(grouped_gemm(x, weight, sizes), expected)
        seconds = bench.measure(functools.partial(grouped_gemm, x, weight, sizes))
        loop_seconds = bench.measure(functools.partial(per_expert.forward_native, x, weight, sizes))
        shape = (
            f"{tokens} tokens x top {scale.experts_per_token} of {scale.experts} experts, "
            f"{in_features} -> {out_features}"
        )
        versus = f"{loop_seconds / seconds:.2f}x matmul per expert"
        name = f"MoE grouped GEMM, {label}"
        if label == "prefill":
            flops = 2 * len(experts) * in_features * out_features
            rows.append(flops_row(bench, name, shape, seconds, flops, versus, check))
            continue
        used = sum(size > 0 for size in sizes)
        moved = (
            used * out_features * in_features + x.numel() + len(experts) * out_features
        ) * x.element_size()
        rows.append(bandwidth_row(bench, name, shape, seconds, moved, versus, check))
    return rows
