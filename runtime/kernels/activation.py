"""SiLU-and-mul: the SwiGLU gate, reading the fused gate/up projection once and writing half as much."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the activation dtype before the product, as torch's silu(gate) * up does.
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * intermediate] = cat(gate, up) -> silu(gate) * up, [num_tokens, intermediate]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(
            f"x must be [num_tokens, 2 * intermediate], contiguous in its last dim, got {tuple(x.shape)}"
        )
    num_tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    check_device(x)
    block = min(1024, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
        out, x, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=4
    )
    return out
