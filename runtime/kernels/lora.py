"""Batched LoRA for a step that mixes adapters (Punica's SGMV): gather each adapter's tokens, shrink them to
its rank, expand them into the projection's output, added onto the base projection's result.

A step's tokens are grouped by adapter slot once (`plan_lora_tokens`, shared by every layer) and cut into
tiles of up to BLOCK_M tokens of one slot; base-model tokens (slot -1) are in no tile and never touched.
Two launches per projection:

- shrink: one program per (tile, slice, K range) computes x[tokens] @ A[slice, slot].T in float32, so each
  adapter's A is read once per tile instead of once per token; decode steps, which have few tiles, split
  the input dimension across programs (float32 atomic adds) to keep the device busy;
- expand: one program per (tile, output block, slice) multiplies the shrunk rows, rounded to the activation
  dtype as torch's matmul rounds them, by the slot's B and adds the result into the output in place.

Weights are laid out as `kvfleet.runtime.lora.layers.LoRALinear` keeps them: A [slices * slots * rank, in]
(slice-major, then slot) and B [out, slots * rank]; every adapter is padded with zeros to the same rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device, upcast_bf16_dots

# Tokens per tile: decode steps have a few tokens per adapter, prefill chunks many (tl.dot needs >= 16).
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
# A shrink program's share of the input dimension is never cut below this many columns.
MIN_SPLIT_K_COLUMNS = 512


@dataclass(frozen=True)
class LoRATokenPlan:
    """One step's tokens grouped by adapter slot, built once and used by every adapted projection."""

    # int32 [num_lora_tokens]: indices of the tokens that run with an adapter, grouped by slot.
    sorted_tokens: torch.Tensor
    # int32 [num_tiles, 3]: (slot, first index into sorted_tokens, number of tokens) of each tile.
    tile_map: torch.Tensor
    num_tiles: int
    block_m: int


def plan_lora_tokens(token_slots: np.ndarray, device: torch.device) -> LoRATokenPlan | None:
    """token_slots [num_tokens]: each token's adapter slot, -1 for the base model. None: no token has one."""
    lora_tokens = np.flatnonzero(token_slots >= 0)
    if lora_tokens.size == 0:
        return None
    sorted_tokens = lora_tokens[np.argsort(token_slots[lora_tokens], kind="stable")]
    slots, starts, counts = np.unique(token_slots[sorted_tokens], return_index=True, return_counts=True)
    block_m = SMALL_BLOCK_M if counts.max() <= SMALL_BLOCK_M else LARGE_BLOCK_M
    tiles_per_slot = -(-counts // block_m)
    tile_slot = np.repeat(slots, tiles_per_slot)
    first_tile = np.cumsum(tiles_per_slot) - tiles_per_slot
    tile_in_slot = np.arange(tile_slot.size) - np.repeat(first_tile, tiles_per_slot)
    tile_start = np.repeat(starts, tiles_per_slot) + tile_in_slot * block_m
    tile_count = np.minimum(block_m, np.repeat(starts + counts, tiles_per_slot) - tile_start)
    tile_map = np.stack([tile_slot, tile_start, tile_count], axis=1).astype(np.int32)
    return LoRATokenPlan(
        sorted_tokens=torch.from_numpy(sorted_tokens.astype(np.int32)).to(device, non_blocking=True),
        tile_map=torch.from_numpy(tile_map).to(device, non_blocking=True),
        num_tiles=tile_map.shape[0],
        block_m=block_m,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def choose_split_k(num_programs: int, in_features: int, num_sms: int) -> int:
    """How many input ranges each shrink tile is cut into so the device has about two programs per
    multiprocessor, each range at least MIN_SPLIT_K_COLUMNS wide; 1 without a device to fill."""
    if num_sms == 0 or num_programs >= 2 * num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(wanted, in_features // MIN_SPLIT_K_COLUMNS, 16))


@triton.jit
def _tile_tokens(tile_map_ptr, sorted_tokens_ptr, tile, BLOCK_M: tl.constexpr):
    """(slot, token indices, which of the BLOCK_M rows are tokens) of one tile."""
    slot = tl.load(tile_map_ptr + 3 * tile)
    first = tl.load(tile_map_ptr + 3 * tile + 1)
    count = tl.load(tile_map_ptr + 3 * tile + 2)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < count
    tokens = tl.load(sorted_tokens_ptr + first + rows, mask=row_valid, other=0).to(tl.int64)
    return slot, tokens, row_valid


@triton.jit
def _lora_shrink_kernel(
    shrunk_ptr,
    x_ptr,
    lora_a_ptr,
    sorted_tokens_ptr,
    tile_map_ptr,
    stride_x,
    stride_a,
    stride_shrunk_token,
    stride_shrunk_slice,
    in_features,
    slot_rows,
    columns_per_split,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    lora_slice = tl.program_id(1)
    split = tl.program_id(2)
    slot, tokens, row_valid = _tile_tokens(tile_map_ptr, sorted_tokens_ptr, tl.program_id(0), BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    rank_valid = ranks < RANK
    a_rows = (lora_slice * slot_rows + slot * RANK + ranks).to(tl.int64)

    k_begin = split * columns_per_split
    k_end = tl.minimum(k_begin + columns_per_split, in_features)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        columns = k + tl.arange(0, BLOCK_K)
        column_valid = columns < k_end
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + columns[None, :],
            mask=row_valid[:, None] & column_valid[None, :],
            other=0.0,
        )
        a_t = tl.load(
            lora_a_ptr + a_rows[None, :] * stride_a + columns[:, None],
            mask=rank_valid[None, :] & column_valid[:, None],
            other=0.0,
        )
        if UPCAST_DOTS:
            x = x.to(tl.float32)
            a_t = a_t.to(tl.float32)
        acc += tl.dot(x, a_t, input_precision="ieee")

    targets = (
        shrunk_ptr + tokens[:, None] * stride_shrunk_token + lora_slice * stride_shrunk_slice + ranks[None, :]
    )
    mask = row_valid[:, None] & rank_valid[None, :]
    if ATOMIC:
        tl.atomic_add(targets, acc, mask=mask)
    else:
        tl.store(targets, acc, mask=mask)


@triton.jit
def _lora_expand_kernel(
    out_ptr,
    shrunk_ptr,
    lora_b_ptr,
    sorted_tokens_ptr,
    tile_map_ptr,
    slice_starts_ptr,
    stride_out,
    stride_b,
    stride_shrunk_token,
    stride_shrunk_slice,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    column_block = tl.program_id(1)
    lora_slice = tl.program_id(2)
    slot, tokens, row_valid = _tile_tokens(tile_map_ptr, sorted_tokens_ptr, tl.program_id(0), BLOCK_M)
    slice_start = tl.load(slice_starts_ptr + lora_slice)
    slice_end = tl.load(slice_starts_ptr + lora_slice + 1)
    ranks = tl.arange(0, BLOCK_R)
    rank_valid = ranks < RANK
    # Blocks past the end of a narrower slice (k and v beside q) have no valid column and do nothing.
    columns = slice_start + column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    column_valid = columns < slice_end

    shrunk = tl.load(
        shrunk_ptr
        + tokens[:, None] * stride_shrunk_token
        + lora_slice * stride_shrunk_slice
        + ranks[None, :],
        mask=row_valid[:, None] & rank_valid[None, :],
        other=0.0,
    ).to(lora_b_ptr.dtype.element_ty)
    b_t = tl.load(
        lora_b_ptr + columns[None, :].to(tl.int64) * stride_b + (slot * RANK + ranks)[:, None],
        mask=rank_valid[:, None] & column_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOTS:
        shrunk = shrunk.to(tl.float32)
        b_t = b_t.to(tl.float32)
    delta = tl.dot(shrunk, b_t, input_precision="ieee")
    targets = out_ptr + tokens[:, None] * stride_out + columns[None, :]
    mask = row_valid[:, None] & column_valid[None, :]
    base = tl.load(targets, mask=mask, other=0.0).to(tl.float32)
    tl.store(targets, (base + delta).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    plan: LoRATokenPlan,
    slice_sizes: Sequence[int],
    slice_starts: torch.Tensor,
    *,
    rank: int,
    split_k: int | None = None,
) -> None:
    """output [num_tokens, out] += each token's LoRA update, in place; tokens outside `plan` are untouched.

    x [num_tokens, in]; lora_a [slices * slots * rank, in]; lora_b [out, slots * rank]; slice_sizes: each
    slice's rows of the output, in order (summing to out), and slice_starts their int32 prefix sums on
    x's device. split_k: input ranges per shrink tile (None: enough to fill the device).
    """
    num_tokens, in_features = x.shape
    num_slices = len(slice_sizes)
    if output.shape != (num_tokens, sum(slice_sizes)):
        raise ValueError(f"output {tuple(output.shape)} must be [{num_tokens}, {sum(slice_sizes)}]")
    slot_rows = lora_b.shape[1]
    if lora_a.shape != (num_slices * slot_rows, in_features) or slot_rows % rank:
        raise ValueError(
            f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} do not hold {num_slices} slices "
            f"of rank-{rank} slots for {in_features} inputs"
        )
    if lora_b.shape[0] != output.shape[1]:
        raise ValueError(f"lora_b has {lora_b.shape[0]} rows for an output of {output.shape[1]}")
    if slice_starts.shape != (num_slices + 1,):
        raise ValueError(f"slice_starts must hold {num_slices + 1} offsets, got {tuple(slice_starts.shape)}")
    for name, tensor in (("x", x), ("output", output), ("lora_a", lora_a), ("lora_b", lora_b)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if not (x.dtype == output.dtype == lora_a.dtype == lora_b.dtype):
        raise ValueError("x, output and the LoRA weights must share one dtype")
    check_device(output, x, lora_a, lora_b, plan.sorted_tokens, plan.tile_map, slice_starts)

    num_programs = plan.num_tiles * num_slices
    if split_k is None:
        split_k = choose_split_k(num_programs, in_features, _num_sms(x.device))
    columns_per_split = triton.cdiv(in_features, split_k)
    block_r = max(16, triton.next_power_of_2(rank))
    upcast = upcast_bf16_dots(x.dtype)
    alloc = torch.zeros if split_k > 1 else torch.empty
    # Rows of base-model tokens stay unwritten: no program reads them.
    shrunk = alloc((num_tokens, num_slices, rank), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(plan.num_tiles, num_slices, split_k)](
        shrunk,
        x,
        lora_a,
        plan.sorted_tokens,
        plan.tile_map,
        x.stride(0),
        lora_a.stride(0),
        shrunk.stride(0),
        shrunk.stride(1),
        in_features,
        slot_rows,
        columns_per_split,
        RANK=rank,
        BLOCK_M=plan.block_m,
        BLOCK_R=block_r,
        BLOCK_K=64 if x.dtype == torch.float32 else 128,
        ATOMIC=split_k > 1,
        UPCAST_DOTS=upcast,
        num_warps=4,
    )
    block_n = 64 if x.dtype == torch.float32 else 128
    _lora_expand_kernel[(plan.num_tiles, triton.cdiv(max(slice_sizes), block_n), num_slices)](
        output,
        shrunk,
        lora_b,
        plan.sorted_tokens,
        plan.tile_map,
        slice_starts,
        output.stride(0),
        lora_b.stride(0),
        shrunk.stride(0),
        shrunk.stride(1),
        RANK=rank,
        BLOCK_M=plan.block_m,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        UPCAST_DOTS=upcast,
        # A tall tile's accumulator spread over more threads: 4 warps would need over 200 registers each.
        num_warps=8 if plan.block_m >= LARGE_BLOCK_M else 4,
    )
