"""Weight-only int8 projections on CUDA: y = x @ (w * scale)^T + bias, with the weight read as int8.

One program computes a [BLOCK_M, BLOCK_N] tile of the output, walking the input dimension BLOCK_K columns at
a time: each [BLOCK_N, BLOCK_K] tile of the int8 weight is loaded, converted to the activations' dtype
(exact: int8 values fit every float format) and multiplied into the activations, and the tile's partial
product is scaled with its group's scales (BLOCK_K divides the group size, so a tile lies in one group)
before it joins the float32 accumulator. Scaling the [BLOCK_M, BLOCK_N] product rather than dequantizing
the [BLOCK_N, BLOCK_K] weight tile does a fraction of the multiplications at decode's few rows: on an H200,
a batch-1 step of Llama-3-8B's gate and up projection took 65 us dequantizing and 44 us scaling the product
(cuBLAS on the bf16 weight: 67 us). The float weight is never written to memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device, upcast_bf16_dots

# Tilings for decode's few rows and for more, among the fastest of a sweep on an H200 (docs/benchmarks.md).
_FEW_ROWS = 16
_FEW_ROWS_TILING = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
_MANY_ROWS_TILING = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
_BLOCK_K_CHOICES = (128, 64, 32, 16)  # tl.dot needs at least 16


def block_k(in_features: int, groups: int) -> int | None:
    """The input columns a program takes at once for this weight, or None when no choice fits (a group size
    that is not a multiple of 16)."""
    group_size = in_features // groups
    if groups == 1:
        return _BLOCK_K_CHOICES[0]
    return next((k for k in _BLOCK_K_CHOICES if group_size % k == 0), None)


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    rows,
    out_features,
    in_features,
    groups,
    group_size,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    FLOAT32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row_ids = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = row_ids < rows
    feature_ok = features < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        columns = start + tl.arange(0, BLOCK_K)
        column_ok = columns < in_features
        x = tl.load(
            x_ptr + row_ids[:, None] * in_features + columns[None, :],
            mask=row_ok[:, None] & column_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + features[:, None] * in_features + columns[None, :],
            mask=feature_ok[:, None] & column_ok[None, :],
            other=0,
        )
        scale = tl.load(scale_ptr + features * groups + start // group_size, mask=feature_ok, other=0.0)
        if UPCAST:
            partial = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        elif FLOAT32:
            partial = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")  # no TF32 rounding
        else:
            partial = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += partial * scale.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + row_ids[:, None] * out_features + features[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & feature_ok[None, :],
    )


def int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] (float16, bfloat16 or float32), weight [out, in] int8, scale [out, groups] ->
    [rows, out] in x's dtype."""
    check_device(x, weight, scale)
    rows, in_features = x.shape
    out_features, groups = scale.shape
    chosen_k = block_k(in_features, groups)
    if chosen_k is None:
        raise ValueError(f"int8_matmul: group size {in_features // groups} is not a multiple of 16")
    x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    tiling = _FEW_ROWS_TILING if rows <= _FEW_ROWS else _MANY_ROWS_TILING
    grid = (triton.cdiv(rows, tiling["BLOCK_M"]), triton.cdiv(out_features, tiling["BLOCK_N"]))
    _int8_matmul_kernel[grid](
        x,
        weight.contiguous(),
        scale.contiguous(),
        bias if bias is not None else scale,
        out,
        rows,
        out_features,
        in_features,
        groups,
        in_features // groups,
        HAS_BIAS=bias is not None,
        UPCAST=upcast_bf16_dots(x.dtype),
        FLOAT32=x.dtype == torch.float32,
        BLOCK_K=chosen_k,
        **tiling,
    )
    return out
