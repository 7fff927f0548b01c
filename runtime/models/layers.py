"""The per-token operations of Llama-family models, kept apart so that fused kernels can replace them.

The modules here are plain torch; the model calls the fused Triton versions instead on CUDA
(`kvfleet.runtime.kernels.fused_layers`), and on the CPU runs its projections through oneDNN.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# KVFLEET_ONEDNN_LINEAR=0 keeps CPU projections on torch's default BLAS, e.g. to compare the two.
ONEDNN_ENV_VAR = "KVFLEET_ONEDNN_LINEAR"
# Fewer rows are padded to this many: oneDNN's kernel for one to three rows streams the weights from memory
# more slowly than its kernel for four (at batch 1 the projections took 5 to 10% less time, padding included).
_ONEDNN_MIN_ROWS = 4


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked into oneDNN's blocked layout for CPU inference.

    On x86 CPUs oneDNN's float32 GEMM is two to three times faster than the default BLAS for the
    matrix shapes of a serving step (and it still accumulates in float32).
    """

    packed_weight: torch.Tensor | None = None
    # Zero rows that pad a smaller input up to _ONEDNN_MIN_ROWS (a concatenation is the cheapest padding).
    _padding_rows: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Replace the dense weight by its packed copy; afterwards the layer is inference-only."""
        weight = self.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self._padding_rows = weight.new_zeros(_ONEDNN_MIN_ROWS - 1, self.in_features)
        self.weight = None  # type: ignore[assignment]  # the packed copy replaces it, not doubles it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if self._padding_rows is not None and x.dim() == 2 and rows < _ONEDNN_MIN_ROWS:
            padded = torch.cat((x, self._padding_rows[: _ONEDNN_MIN_ROWS - rows]))
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")[
                :rows
            ]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Pack every `Linear` of a CPU model for oneDNN when this torch build has it; returns how many."""
    if os.environ.get(ONEDNN_ENV_VAR, "1") == "0":
        logger.info("oneDNN projections are off (%s=0)", ONEDNN_ENV_VAR)
        return 0
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        logger.info("oneDNN is not available in this torch build; projections use the default BLAS")
        return 0
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight.device.type == "cpu"]
    if any(m.weight.dtype not in (torch.float32, torch.bfloat16) for m in linears):
        return 0
    for module in linears:
        module.pack_for_cpu()
    return len(linears)


class RMSNorm(nn.Module):
    """Root-mean-square norm; with `residual`, adds it first and returns the sum as the new residual."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        residual = x
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), residual
        # Half-precision inputs are normalised in float32, as the reference implementations do.
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return normed * self.weight, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [..., 2 * intermediate] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope_inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding for the `rope_type`s Llama-family checkpoints use."""
    theta = float(rope["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 stretches long wavelengths by `factor`, keeps short ones, and blends the band in between.
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    original_context = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original_context / high_freq_factor) & (
        wavelen <= original_context / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by position (the "rotate half" layout of Hugging Face checkpoints)."""

    def __init__(self, head_dim: int, max_position: int, rope: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos then sin of each frequency; positions' rows are gathered once a step.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] cos and signed sin for `rotate_`, computed once per step and shared by
        every layer: cos twice over, and sin negated on the first half (where rotate-half subtracts)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> RotaryStep:
        """One step's rotation, shared by every layer: the fused kernel reads the cache by position itself."""
        cos_sin = None if fused else self.cos_sin(positions, dtype)
        return RotaryStep(positions, self.cos_sin_cache, cos_sin)

    @staticmethod
    def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate x [num_tokens, num_heads, head_dim] in place (it may be a view into a wider tensor):
        (x1, x2) -> (x1 * cos - x2 * sin, x2 * cos + x1 * sin), in four tensor operations."""
        swapped = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)  # (-x2 * sin, x1 * sin)
        x.mul_(cos).add_(swapped)


@dataclass
class RotaryStep:
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # (cos, signed sin); None when the fused kernel rotates
