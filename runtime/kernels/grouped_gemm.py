"""Grouped GEMM for mixture-of-experts layers: rows sorted by expert, each expert's rows times its weight
(transposed), every expert in one launch.

The rows are cut into tiles of up to BLOCK_M rows of one expert (the tile map, built on the host from the
group sizes, which the caller holds already), and each program computes one tile's BLOCK_N output columns,
so that an expert's weight is read once per tile instead of once per row. Products accumulate in float32, in
IEEE precision (no TF32), and are rounded to the activations' dtype once, as torch's matmul does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device, upcast_bf16_dots

# Tilings for a decode step, which routes a few rows to each expert, and for a prefill chunk's many (tl.dot
# needs 16 rows at least): the fastest of a sweep on an H200 at Mixtral-8x7B's shapes (docs/benchmarks.md).
_FEW_ROWS_TILING = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
_MANY_ROWS_TILING = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


@triton.jit
def _grouped_gemm_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    tile_map_ptr,
    out_features,
    in_features,
    stride_x,
    stride_weight_expert,
    stride_weight_row,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_map_ptr + 3 * tile).to(tl.int64)
    first = tl.load(tile_map_ptr + 3 * tile + 1).to(tl.int64)
    count = tl.load(tile_map_ptr + 3 * tile + 2)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < count
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < out_features
    x_rows = x_ptr + (first + rows)[:, None] * stride_x
    weight_cols = weight_ptr + expert * stride_weight_expert + cols[None, :] * stride_weight_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < in_features
        x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        weight_t = tl.load(weight_cols + ks[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if UPCAST_DOTS:
            x = x.to(tl.float32)
            weight_t = weight_t.to(tl.float32)
        acc += tl.dot(x, weight_t, input_precision="ieee")
    out = out_ptr + (first + rows)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def _tile_map(sizes: list[int], block_m: int, device: torch.device) -> torch.Tensor:
    """int32 [tiles, 3]: (expert, first row, rows) of each tile of up to block_m rows."""
    tiles = []
    first = 0
    for expert, size in enumerate(sizes):
        tiles += [(expert, first + offset, min(block_m, size - offset)) for offset in range(0, size, block_m)]
        first += size
    return torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x [rows, in] in consecutive groups, sizes[e] rows for expert e; weight [experts, out, in]. Returns
    [rows, out]: each group's rows times its expert's weight transposed."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or len(sizes) != weight.shape[0]:
        raise ValueError(
            f"x [rows, in] and weight [experts, out, in] with a size per expert, got {tuple(x.shape)}, "
            f"{tuple(weight.shape)} and {len(sizes)} sizes"
        )
    if sum(sizes) != x.shape[0] or x.stride(1) != 1 or weight.stride(2) != 1:
        raise ValueError(
            "the sizes must add up to x's rows, and x and weight be contiguous in their last dim"
        )
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    check_device(x, weight)
    few = max(sizes) <= _FEW_ROWS_TILING["BLOCK_M"]
    tiling = _FEW_ROWS_TILING if few else _MANY_ROWS_TILING
    tile_map = _tile_map(sizes, tiling["BLOCK_M"], x.device)
    grid = (tile_map.shape[0], triton.cdiv(weight.shape[1], tiling["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        out,
        x,
        weight,
        tile_map,
        weight.shape[1],
        weight.shape[2],
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        UPCAST_DOTS=upcast_bf16_dots(x.dtype),
        **tiling,
    )
    return out
