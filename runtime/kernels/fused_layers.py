"""The switch the model's layers consult before using a fused kernel instead of their torch code: Triton's
on CUDA, the C++ operations of cpu_layers.cpp for float32 on the CPU.

Importing this module imports neither: Triton's kernels are loaded the first time a CUDA tensor asks for
them, so CPU-only processes never pay for (or depend on) Triton, and the C++ operations are built when an
engine loads (`prepare`). KVFLEET_FUSED_KERNELS=0 turns both off, e.g. to compare against the torch layers.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path

import torch
from kvfleet.runtime.kernels.cpu_build import build_cpu_ops

logger = logging.getLogger(__name__)

ENV_VAR = "KVFLEET_FUSED_KERNELS"
_CPU_SOURCE = Path(__file__).with_name("cpu_layers.cpp")


def _switched_on() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


@functools.cache
def _kernels_available() -> bool:
    if not _switched_on():
        logger.info("fused layer kernels are off (%s=0)", ENV_VAR)
        return False
    if importlib.util.find_spec("triton") is None:
        logger.info("fused layer kernels are off: triton is not installed")
        return False
    return True


@functools.cache
def _cpu_ops_available() -> bool:
    return _switched_on() and build_cpu_ops("kvfleet_cpu_layers", _CPU_SOURCE, "the CPU layer operations")


def prepare(device: torch.device, dtype: torch.dtype) -> None:
    """Builds (or loads from the cache) the operations that activations of this device and dtype will use,
    so that a model's first step does not pay for it: an engine calls it while it loads."""
    if device.type == "cpu" and dtype == torch.float32:
        _cpu_ops_available()


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels should replace the torch layer ops for this activation tensor."""
    return _runs_on_cpu_ops(x) or enabled_on(x.device)


def _runs_on_cpu_ops(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and _cpu_ops_available()


def enabled_on(device: torch.device) -> bool:
    """Whether the fused Triton kernels replace the torch layer ops on this device."""
    return device.type == "cuda" and _kernels_available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual), or (norm(x) * weight, x) without a residual; x may
    have any number of leading dimensions."""
    if _runs_on_cpu_ops(x):
        return torch.ops.kvfleet_cpu_layers.rms_norm(x, residual, weight, eps)
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
    if _runs_on_cpu_ops(query):
        torch.ops.kvfleet_cpu_layers.rotary_embedding_(positions, query, key, cos_sin_cache)
        return
    from kvfleet.runtime.kernels.rotary import rotary_embedding_ as kernel

    kernel(positions, query, key, cos_sin_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _runs_on_cpu_ops(gate_up):
        return torch.ops.kvfleet_cpu_layers.silu_and_mul(gate_up)
    from kvfleet.runtime.kernels.activation import silu_and_mul as kernel

    return kernel(gate_up)
