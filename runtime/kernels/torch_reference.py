"""Plain torch versions of every kernel in this package: slow, obviously correct, and the yardstick the
kernels are tested and benchmarked against. Same arguments and results as the kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = kv_cache.shape[3:]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[keep]
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[keep]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """One request at a time: gather its context through the block table (from the first new token's
    window on), then causal softmax attention with the new tokens at the end of the context, each over its
    `sliding_window` latest positions if given. Computed in `compute_dtype`, returned in query's dtype."""
    num_heads = query.shape[1]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for request, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[request], starts[request + 1]
        first_query_position = seq_len - (end - begin)
        first = 0 if sliding_window is None else max(0, first_query_position - sliding_window + 1)
        positions = torch.arange(first, seq_len, device=query.device)
        blocks = block_tables[request, positions // block_size].long()
        keys = kv_cache[0, blocks, positions % block_size].to(compute_dtype)
        values = kv_cache[1, blocks, positions % block_size].to(compute_dtype)
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[begin:end].to(compute_dtype)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        query_positions = torch.arange(seq_len - (end - begin), seq_len, device=query.device)
        hidden = positions[None, :] > query_positions[:, None]
        if sliding_window is not None:
            hidden |= positions[None, :] <= query_positions[:, None] - sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype), x


def rotary_embedding_(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    half_dim = query.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].float()
    cos, sin = cos_sin[:, None, :half_dim], cos_sin[:, None, half_dim:]
    for x in (query, key):
        x1, x2 = x[..., :half_dim].float(), x[..., half_dim:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_cos_sin_cache(head_dim: int, max_position: int, base: float = 10000.0) -> torch.Tensor:
    """cat(cos, sin) table in the layout `rotary_embedding_` reads, float32 (no frequency scaling)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
