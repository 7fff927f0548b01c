"""The per-token operations of Llama-family models.

RMSNorm, the rotary embedding and SiLU-and-mul each bind, when built, the C++ operation for float32 on the
CPU, Triton's kernel on CUDA, or their torch code (`kvfleet.runtime.kernels.fused_layers`); on the CPU the
projections run through oneDNN.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from kvfleet.runtime.kernels.cpu_features import onednn_has_avx512, onednn_packs
from kvfleet.runtime.kernels.fused_layers import CustomOp
from kvfleet.runtime.models.rope import LENGTH_DEPENDENT_ROPE_TYPES
from torch import nn

logger = logging.getLogger(__name__)

# KVFLEET_ONEDNN_LINEAR=0 keeps CPU projections on torch's default BLAS, e.g. to compare the two.
ONEDNN_ENV_VAR = "KVFLEET_ONEDNN_LINEAR"
# With AVX-512, fewer rows are padded to this many: there oneDNN's kernel for one to three rows streams the
# weights from memory more slowly than its kernel for four (at batch 1 the projections took 5 to 10% less
# time, padding included). With AVX2 alone its one-row kernel is the fast one: padding a row to four doubled
# the `small` model's projections (18.6 against 9.5 ms on one thread, 10.6 against 6.0 on two), and two or
# three rows took the same time either way.
_ONEDNN_MIN_ROWS = 4


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked into oneDNN's blocked layout for CPU inference.

    On x86 CPUs oneDNN's float32 GEMM is two to three times faster than the default BLAS for the
    matrix shapes of a serving step (and it still accumulates in float32).
    """

    packed_weight: torch.Tensor | None = None
    # Zero rows that pad a smaller input up to _ONEDNN_MIN_ROWS (a concatenation is the cheapest padding).
    padding_rows: torch.Tensor | None = None

    def pack_for_cpu(self, pad_rows: bool) -> None:
        """Replace the dense weight by its packed copy; afterwards the layer is inference-only. `pad_rows`:
        whether fewer than _ONEDNN_MIN_ROWS rows are padded to that many."""
        weight = self.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        if pad_rows:
            self.padding_rows = weight.new_zeros(_ONEDNN_MIN_ROWS - 1, self.in_features)
        self.weight = None  # type: ignore[assignment]  # the packed copy replaces it, not doubles it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if self.padding_rows is not None and x.dim() == 2 and rows < _ONEDNN_MIN_ROWS:
            padded = torch.cat((x, self.padding_rows[: _ONEDNN_MIN_ROWS - rows]))
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")[
                :rows
            ]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def copy_checkpoint_tensor(target: torch.Tensor, tensor: torch.Tensor, hf_name: str) -> None:
    """Copy a checkpoint tensor into its place in the model, refusing one of another shape."""
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(tensor)


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Pack every `Linear` of a CPU model for oneDNN when this torch build and this CPU can run it for the
    weights' dtype; returns how many."""
    if os.environ.get(ONEDNN_ENV_VAR, "1") == "0":
        logger.info("oneDNN projections are off (%s=0)", ONEDNN_ENV_VAR)
        return 0
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        logger.info("oneDNN is not available in this torch build; projections use the default BLAS")
        return 0
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight.device.type == "cpu"]
    if not all(onednn_packs(dtype) for dtype in {m.weight.dtype for m in linears}):
        return 0
    pad_rows = onednn_has_avx512()
    for module in linears:
        module.pack_for_cpu(pad_rows)
    return len(linears)


class RMSNorm(CustomOp):
    """Root-mean-square norm of x's last dimension (x may have any number of leading ones): with `residual`,
    (norm(x + residual) * weight, x + residual), else (norm(x) * weight, x)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(
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

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.kvfleet_cpu_layers.rms_norm(x, residual, self.weight, self.eps)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from kvfleet.runtime.kernels.rms_norm import rms_norm

        shape = x.shape
        rows = x if x.dim() == 2 else x.reshape(-1, shape[-1])
        out, new_residual = rms_norm(
            rows, self.weight, self.eps, None if residual is None else residual.reshape(rows.shape)
        )
        if residual is None:
            new_residual = x
        return out.view(shape), new_residual.view(shape)


class SiluAndMul(CustomOp):
    """SwiGLU on a fused [..., 2 * intermediate] projection: silu(gate) * up."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvfleet_cpu_layers.silu_and_mul(gate_up)

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        from kvfleet.runtime.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up)


def rope_inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding and the factor that scales its cos and sin, for the static
    `rope_type`s (those whose angles depend on the position alone). `rope` is ModelConfig.rope, whose
    defaults (original length, factor) are already filled in."""
    theta = float(rope["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, rope)
    raise ValueError(f"rope_type {rope_type!r} has no position-only frequencies")


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


def _yarn_inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # YaRN keeps the dimensions that turn many times over the original context (beta_fast rotations or more),
    # interpolates those that turn less than beta_slow times by `factor`, ramps linearly in between, and
    # sharpens attention by scaling cos and sin.
    theta = float(rope["rope_theta"])
    factor = float(rope["factor"])
    original_context = float(rope["original_max_position_embeddings"])
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def dimension_turning(rotations: float) -> float:
        return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    position_frequencies = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    kept = 1 - ramp
    inv_freq = (1.0 / (factor * position_frequencies)) * (1 - kept) + (1.0 / position_frequencies) * kept
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope_attention_factor(rope: dict[str, Any]) -> float:
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope["factor"])
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"]))


def _signed_cos_sin(
    cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, 1, head_dim] cos and signed sin for `rotate_`, computed once per step and shared by every
    layer: cos twice over, and sin negated on the first half (where rotate-half subtracts)."""
    cos, sin = cache.index_select(0, rows).to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _cos_sin_rows(angles: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, head_dim / 2] angles -> [n, head_dim] rows cat(cos, sin), each scaled."""
    rows = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return rows * scale if scale != 1.0 else rows


class RotaryEmbedding(CustomOp):
    """Rotates query and key heads by position (the "rotate half" layout of Hugging Face checkpoints): once a
    step `prepare` finds each token's row of the cos/sin table, then each layer calls the embedding on its
    query and key with that step.

    `dynamic` and `longrope` angles depend on the length of the sequence as well, as Transformers computes
    them during generation: the whole prompt is rotated for the prompt's length, and each later token for the
    length it brings the sequence to (`dynamic` only scales past the original length; `longrope` switches from
    its short to its long factors there). A step then needs each token's `sequence_lengths`:
    max(prompt length, position + 1).
    """

    def __init__(self, head_dim: int, max_position: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.rope_type = rope.get("rope_type", "default")
        self.original_max_position = int(rope.get("original_max_position_embeddings") or max_position)
        positions = torch.arange(max_position, dtype=torch.float32)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        if self.rope_type == "longrope":
            # Rows [0, max_position) with the short factors, then the same positions with the long ones.
            base_frequencies = float(rope["rope_theta"]) ** exponents
            scale = _longrope_attention_factor(rope)
            cache = torch.cat(
                [
                    _cos_sin_rows(
                        torch.outer(positions, 1.0 / (torch.tensor(factors) * base_frequencies)), scale
                    )
                    for factors in (rope["short_factor"], rope["long_factor"])
                ]
            )
        elif self.rope_type == "dynamic":
            # Rows past the original length are computed per step; this cache serves the original frequencies.
            self.theta = float(rope["rope_theta"])
            self.factor = float(rope["factor"])
            self.head_dim = head_dim
            self.register_buffer("exponents", exponents, persistent=False)
            cache = _cos_sin_rows(torch.outer(positions, 1.0 / (self.theta**exponents)), 1.0)
        else:
            inv_freq, scale = rope_inverse_frequencies(head_dim, rope)
            cache = _cos_sin_rows(torch.outer(positions, inv_freq), scale)
        self.max_position = max_position
        # [rows, head_dim]: cos then sin of each frequency; the step's rows are gathered once a step.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    @property
    def needs_sequence_lengths(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES

    def prepare(
        self, positions: torch.Tensor, dtype: torch.dtype, sequence_lengths: torch.Tensor | None = None
    ) -> RotaryStep:
        """One step's rotation, shared by every layer; `dtype` is the activations'."""
        rows, cache = positions, self.cos_sin_cache
        if self.needs_sequence_lengths:
            if sequence_lengths is None:
                raise ValueError(f"rope_type {self.rope_type!r} needs each token's sequence length")
            past_original = sequence_lengths > self.original_max_position
            if self.rope_type == "longrope":
                rows = positions + past_original * self.max_position
            elif bool(past_original.any()):
                rows, cache = self._dynamic_rows(positions, sequence_lengths)
        return RotaryStep(rows, cache, dtype)

    def _dynamic_rows(
        self, positions: torch.Tensor, sequence_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK: each token's own cos/sin row, with theta raised for its sequence length (float32, in
        the order of operations Transformers uses, so that long positions agree to the last bits)."""
        lengths = torch.clamp(sequence_lengths, min=self.original_max_position)
        growth = (self.factor * lengths / self.original_max_position) - (self.factor - 1)
        theta = self.theta * growth ** (self.head_dim / (self.head_dim - 2))
        inv_freq = 1.0 / (theta.unsqueeze(1) ** self.exponents)
        table = _cos_sin_rows(positions.float().unsqueeze(1) * inv_freq, 1.0)
        return torch.arange(len(positions), device=positions.device), table

    def forward_native(
        self,
        step: RotaryStep,
        query: torch.Tensor,
        key: torch.Tensor,
        query_and_key: torch.Tensor | None = None,
    ) -> None:
        """Rotates query [num_tokens, heads, head_dim] and key [num_tokens, kv_heads, head_dim] in place, as
        the kernels do. `query_and_key`, when key follows query in one tensor, is the view over both: torch
        then turns them in one rotation (a kernel turns both in one call anyway)."""
        cos, signed_sin = step.cos_sin
        for heads in (query, key) if query_and_key is None else (query_and_key,):
            self.rotate_(heads, cos, signed_sin)

    def forward_cpu(
        self,
        step: RotaryStep,
        query: torch.Tensor,
        key: torch.Tensor,
        query_and_key: torch.Tensor | None = None,
    ) -> None:
        torch.ops.kvfleet_cpu_layers.rotary_embedding_(step.rows, query, key, step.cos_sin_cache)

    def forward_cuda(
        self,
        step: RotaryStep,
        query: torch.Tensor,
        key: torch.Tensor,
        query_and_key: torch.Tensor | None = None,
    ) -> None:
        from kvfleet.runtime.kernels.rotary import rotary_embedding_

        rotary_embedding_(step.rows, query, key, step.cos_sin_cache)

    @staticmethod
    def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate x [num_tokens, num_heads, head_dim] in place (it may be a view into a wider tensor):
        (x1, x2) -> (x1 * cos - x2 * sin, x2 * cos + x1 * sin), in four tensor operations."""
        swapped = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)  # (-x2 * sin, x1 * sin)
        x.mul_(cos).add_(swapped)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL's family): each token has three positions (time, row, column: `positions` is
    [3, num_tokens]) and `mrope_section` says how many of the head's frequencies turn with each, in that
    order. Text tokens have the same three, which makes this the plain rotation for them."""

    def __init__(self, head_dim: int, max_position: int, rope: dict[str, Any]) -> None:
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"M-RoPE with rope_type {rope['rope_type']!r} is not supported (only default)")
        super().__init__(head_dim, max_position, rope)
        section = [int(n) for n in rope["mrope_section"]]
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} does not add up to head_dim / 2 = {head_dim // 2}")
        axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        # For each column of a cos_sin_cache row (cos then sin of each frequency): the axis it turns with.
        self.register_buffer("column_axis", torch.cat([axis, axis])[None, None, :], persistent=False)

    def prepare(
        self, positions: torch.Tensor, dtype: torch.dtype, sequence_lengths: torch.Tensor | None = None
    ) -> RotaryStep:
        """The step's own cos/sin rows, each column from the row of its axis's position."""
        by_axis = self.cos_sin_cache[positions]  # [3, num_tokens, head_dim]
        table = by_axis.gather(0, self.column_axis.expand(1, *by_axis.shape[1:]))[0]
        rows = torch.arange(table.shape[0], device=table.device)
        return RotaryStep(rows, table, dtype)


@dataclass
class RotaryStep:
    rows: torch.Tensor  # each token's row of cos_sin_cache: its position, unless the rope type needs more
    cos_sin_cache: torch.Tensor
    dtype: torch.dtype  # the activations'

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) of the step's rows for the torch rotation: gathered by the first layer that
        rotates with torch and shared by the others; the kernels read the table by row themselves."""
        return _signed_cos_sin(self.cos_sin_cache, self.rows, self.dtype)
