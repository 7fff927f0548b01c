"""The per-token operations of Llama-family models, kept apart so that fused kernels can replace them."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
        self.max_position = max_position

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim / 2] cos and sin, computed once per step and shared by every layer."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim] -> rotated copy."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
