"""RMSNorm with the residual add fused in: one read of x and residual, one write of each result.

Rounding follows the Hugging Face Llama order so results match the torch layer: the sum is rounded to the
activation dtype (it becomes the next residual), normalised in float32, rounded again, then scaled by the
weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device

MAX_HIDDEN_SIZE = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_x,
    stride_residual,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        total = x.to(tl.float32) + tl.load(
            residual_ptr + row * stride_residual + cols, mask=mask, other=0.0
        ).to(tl.float32)
        x = total.to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden_size + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [num_tokens, hidden] (rows may be strided), weight [hidden].

    Returns (norm(x + residual) * weight, x + residual) as new contiguous tensors; without a residual,
    (norm(x) * weight, x), matching `RMSNorm.forward(x, residual=None) -> (out, residual)`.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, hidden] and contiguous in hidden, got {tuple(x.shape)}")
    num_tokens, hidden_size = x.shape
    if weight.shape != (hidden_size,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be a contiguous [{hidden_size}] tensor of x's dtype {x.dtype}, "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden size {hidden_size} is above the kernel's {MAX_HIDDEN_SIZE}")
    if residual is not None and (
        residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype
    ):
        raise ValueError("residual must have x's shape and dtype and be contiguous in hidden")
    check_device(x, weight, *([] if residual is None else [residual]))
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else x
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        out,
        residual_out,
        x,
        residual if residual is not None else x,
        weight,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out, residual_out
