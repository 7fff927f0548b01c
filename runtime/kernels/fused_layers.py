"""The switch the model's layers consult before using a fused Triton kernel instead of their torch code.

Importing this module does not import Triton: the kernels are loaded the first time a CUDA tensor asks
for them, so CPU-only processes never pay for (or depend on) Triton. KVFLEET_FUSED_KERNELS=0 turns the
kernels off, e.g. to compare against the torch layers.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "KVFLEET_FUSED_KERNELS"


@functools.cache
def _kernels_available() -> bool:
    if os.environ.get(ENV_VAR, "1") == "0":
        logger.info("fused layer kernels are off (%s=0)", ENV_VAR)
        return False
    if importlib.util.find_spec("triton") is None:
        logger.info("fused layer kernels are off: triton is not installed")
        return False
    return True


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels should replace the torch layer ops for this activation tensor."""
    return enabled_on(x.device)


def enabled_on(device: torch.device) -> bool:
    """Whether the fused kernels replace the torch layer ops on this device."""
    return device.type == "cuda" and _kernels_available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual), or (norm(x) * weight, x) without a residual; x may
    have any number of leading dimensions."""
    from kvfleet.runtime.kernels.rms_norm import rms_norm as kernel

    shape = x.shape
    rows = x if x.dim() == 2 else x.reshape(-1, shape[-1])
    out, new_residual = kernel(rows, weight, eps, None if residual is None else residual.reshape(rows.shape))
    if residual is None:
        new_residual = x
    return out.view(shape), new_residual.view(shape)


def rotary_embedding_(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates query [tokens, heads, head_dim] and key [tokens, kv_heads, head_dim] in place."""
    from kvfleet.runtime.kernels.rotary import rotary_embedding_ as kernel

    kernel(positions, query, key, cos_sin_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from kvfleet.runtime.kernels.activation import silu_and_mul as kernel

    return kernel(gate_up)
