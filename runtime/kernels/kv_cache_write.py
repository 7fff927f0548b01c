"""Scatter a step's new keys and values into their paged cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token whose K/V must not land anywhere.
    if slot >= 0:
        heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        dims = tl.arange(0, BLOCK_DIM)
        mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
        cache_offsets = (
            (slot // KV_BLOCK_SIZE) * stride_cache_block
            + (slot % KV_BLOCK_SIZE) * stride_cache_token
            + heads[:, None] * stride_cache_head
            + dims[None, :]
        )
        key = tl.load(
            key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask
        )
        value = tl.load(
            value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
            mask=mask,
        )
        tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
        tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] (any token and head strides); kv_cache
    [2, num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping [num_tokens], -1 for padding tokens."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} must be "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must hold one slot per token ({num_tokens}), got {tuple(slot_mapping.shape)}"
        )
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype} must match the cache's {kv_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in head_dim")
    if num_tokens == 0:
        return
    check_device(key, value, kv_cache, slot_mapping)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_dim = triton.next_power_of_2(head_dim)
    # Up to 2048 elements per program: a whole token for most models, in one wide store per thread.
    block_heads = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_dim))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_heads))
    _write_kv_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HEADS=block_heads,
        BLOCK_DIM=block_dim,
        num_warps=4,
    )
