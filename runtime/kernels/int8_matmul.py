"""Weight-only int8 projections on CUDA: y = x @ (w * scale)^T + bias, with the weight read as int8.

One program computes a [BLOCK_M, BLOCK_N] tile of the output, walking the input dimension BLOCK_K columns at
a time: each [BLOCK_N, BLOCK_K] tile of the int8 weight is loaded, dequantized in registers with the scale of
its group (BLOCK_K divides the group size, so a tile lies in one group) and multiplied into the activations
in their own dtype, accumulating in float32. The float weight is never written to memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device, upcast_bf16_dots

BLOCK_N = 64
_BLOCK_K_CHOICES = (64, 32, 16)  # tl.dot needs at least 16


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
        dequantized = w.to(tl.float32) * scale.to(tl.float32)[:, None]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(dequantized))
        elif FLOAT32:
            acc += tl.dot(x, tl.trans(dequantized), input_precision="ieee")  # no TF32 rounding of float32
        else:
            acc += tl.dot(x, tl.trans(dequantized.to(x.dtype)))
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
    block_m = 16 if rows <= 16 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, BLOCK_N))
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
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=chosen_k,
    )
    return out
