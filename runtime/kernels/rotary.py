"""Rotary position embedding (the rotate-half form of Llama, Mistral and Qwen) applied to query and key in
place, both in one launch: each token's cos/sin row is read once for all of its heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    num_heads,
    cos,
    sin,
    HALF_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HALF_DIM)
    mask = (heads < num_heads)[:, None]
    first = x_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF_DIM, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_sin_cache_ptr,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_cache_position,
    num_heads,
    num_kv_heads,
    HALF_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_DIM)
    cos = tl.load(cos_sin_cache_ptr + position * stride_cache_position + dims).to(tl.float32)
    sin = tl.load(cos_sin_cache_ptr + position * stride_cache_position + HALF_DIM + dims).to(tl.float32)
    _rotate_heads(
        query_ptr, token, stride_query_token, stride_query_head, num_heads, cos, sin, HALF_DIM, BLOCK_HEADS
    )
    _rotate_heads(
        key_ptr, token, stride_key_token, stride_key_head, num_kv_heads, cos, sin, HALF_DIM, BLOCK_KV_HEADS
    )


def rotary_embedding_(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim] in place
    (views into a fused QKV output are fine) by the angles of `positions` [num_tokens].

    cos_sin_cache [max_position, head_dim]: row p is cat(cos(p * inv_freq), sin(p * inv_freq)), each
    head_dim / 2 wide, in any float dtype (the rotation itself is done in float32).
    """
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must be [num_tokens, heads, head_dim]"
        )
    num_tokens, num_heads, head_dim = query.shape
    half_dim = head_dim // 2
    if head_dim % 2 or half_dim & (half_dim - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    if positions.shape != (num_tokens,):
        raise ValueError(
            f"positions must hold one position per token ({num_tokens}), got {tuple(positions.shape)}"
        )
    if query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError("query and key must be contiguous in head_dim")
    if num_tokens == 0:
        return
    check_device(positions, query, key, cos_sin_cache)
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        key.shape[1],
        HALF_DIM=half_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(key.shape[1]),
        num_warps=4,
    )
