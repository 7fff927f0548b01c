"""Paged attention for a flattened variable-length batch: prefill chunks (with or without a cached prefix)
and single-token decodes in one launch.

Work is split into query tiles: a tile is up to BLOCK_Q consecutive new tokens of one request, and one
program handles a tile for one KV head, so its rows are those tokens times the query heads sharing that KV
head (BLOCK_M = BLOCK_Q * queries_per_kv rows, padded to a power of two). Every K/V tile it loads serves
all of those heads, which is what makes grouped-query decode memory-bound rather than load-bound.

A program walks the request's keys through its block table, BLOCK_N keys at a time, with an online
softmax. In split-KV mode (few programs, long contexts) the keys are cut into NUM_SPLITS ranges handled by
separate programs, each writing a normalised partial output and its log-sum-exp; a second kernel merges
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from kvfleet.runtime.kernels.triton_utils import check_device, upcast_bf16_dots

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionTiling:
    """Launch shape of one paged attention call; `block_q` follows from `block_m` and the GQA ratio."""

    block_m: int
    block_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_splits"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError("block_m and block_n must be at least 16 (the smallest tensor-core tile)")

    def block_q(self, queries_per_kv: int) -> int:
        if queries_per_kv > self.block_m:
            raise ValueError(
                f"block_m {self.block_m} cannot hold the {queries_per_kv} query heads of a KV head"
            )
        return self.block_m // queries_per_kv


def default_tiling(
    *, queries_per_kv: int, head_dim: int, dtype: torch.dtype, max_query_len: int
) -> AttentionTiling:
    """Tile sizes for one step, without split-KV (see `choose_num_splits`). Steps whose longest query fits
    the smallest row tile (decodes) get it; longer ones a taller tile so each K/V tile serves more rows."""
    min_rows = max(16, triton.next_power_of_2(queries_per_kv))
    block_n = 32 if head_dim > 128 or dtype == torch.float32 else 64
    if max_query_len <= min_rows // queries_per_kv:
        return AttentionTiling(min_rows, block_n, num_warps=4, num_stages=3)
    block_m = max(64, min_rows)
    return AttentionTiling(block_m, block_n, num_warps=8 if block_m >= 128 else 4, num_stages=2)


def choose_num_splits(num_programs: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """How many KV ranges to cut each decode into so the device has about two programs per multiprocessor,
    keeping at least four key tiles per range (shorter ranges cost more in merging than they win)."""
    if num_programs >= 2 * num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, max(num_programs, 1))
    by_length = max(1, max_seq_len // (4 * block_n))
    splits = min(wanted, by_length, 16)
    return 1 << (splits.bit_length() - 1)


def build_tile_map(query_start_loc_cpu: list[int], block_q: int, device: torch.device) -> torch.Tensor:
    """int32 [num_tiles, 2]: (request index, tile index among the request's new tokens) of each query tile."""
    starts = torch.tensor(query_start_loc_cpu, dtype=torch.int64)
    query_lens = starts[1:] - starts[:-1]
    if bool((query_lens < 1).any()):
        raise ValueError("every request in the batch must have at least one new token")
    tiles_per_request = (query_lens + block_q - 1) // block_q
    request_of_tile = torch.repeat_interleave(torch.arange(len(query_lens)), tiles_per_request)
    first_tile = torch.cumsum(tiles_per_request, 0) - tiles_per_request
    tile_in_request = torch.arange(len(request_of_tile)) - first_tile[request_of_tile]
    tile_map = torch.stack([request_of_tile, tile_in_request], dim=1).to(torch.int32)
    return tile_map.to(device, non_blocking=True)


# A window wider than any context: every position at or before the query's is visible.
_NO_WINDOW = 2**30


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_map_ptr,
    scale_log2,
    sliding_window,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_request,
    num_heads,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    request = tl.load(tile_map_ptr + 2 * tile)
    query_tile = tl.load(tile_map_ptr + 2 * tile + 1)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + request)
    cached_len = seq_len - query_len

    # Row r of the tile is new token (query_tile * BLOCK_Q + r // QUERIES_PER_KV) of the request, seen by
    # query head (kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV).
    rows = tl.arange(0, BLOCK_M)
    token_in_request = query_tile * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (token_in_request < query_len)
    position = cached_len + token_in_request
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    token = (query_start + token_in_request).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOTS:
        q = q.to(tl.float32)

    # Keys past the last position any row of this tile attends to are never loaded, nor keys before the
    # window of its first row (their blocks may have been freed).
    last_token_of_tile = tl.minimum(query_len, (query_tile + 1) * BLOCK_Q)
    kv_len = cached_len + last_token_of_tile
    first_key = tl.maximum(cached_len + query_tile * BLOCK_Q - sliding_window + 1, 0)
    num_kv_tiles = tl.cdiv(kv_len, BLOCK_N)
    skipped_kv_tiles = first_key // BLOCK_N
    if NUM_SPLITS == 1:
        first_kv_tile = skipped_kv_tiles
        end_kv_tile = num_kv_tiles
    else:
        tiles_per_split = tl.cdiv(num_kv_tiles - skipped_kv_tiles, NUM_SPLITS)
        first_kv_tile = skipped_kv_tiles + split * tiles_per_split
        end_kv_tile = tl.minimum(first_kv_tile + tiles_per_split, num_kv_tiles)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for rows with no visible key yet.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = block_tables_ptr + request.to(tl.int64) * stride_table_request
    for kv_tile in range(first_kv_tile, end_kv_tile):
        keys = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = (keys < kv_len) & (keys >= first_key)
        block_ids = tl.load(table_row + keys // KV_BLOCK_SIZE, mask=key_valid, other=0)
        slot_offsets = (
            block_ids.to(tl.int64) * stride_cache_block
            + (keys % KV_BLOCK_SIZE) * stride_cache_token
            + kv_head * stride_cache_head
        )
        k_t = tl.load(
            key_cache_ptr + slot_offsets[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        # Masked-out slots may hold anything (NaN included), so V must be zero there: 0 * NaN poisons P @ V.
        v = tl.load(
            value_cache_ptr + slot_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if UPCAST_DOTS:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, k_t, input_precision="ieee") * scale_log2
        visible = (keys[None, :] <= position[:, None]) & (keys[None, :] > position[:, None] - sliding_window)
        visible &= key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        out_offsets = token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # A range can hold no key a row may see (all past its position): weight zero in the merge.
        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        # partial_out is [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PADDED], partial_lse the same without
        # the last dimension, both contiguous float32.
        partial_row = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)
        tl.store(
            partial_out_ptr + partial_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
            out,
            mask=row_valid[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    stride_o_token,
    stride_o_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * num_heads + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits)
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    partial = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM_PADDED + dims[None, :]
    )
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile_map: torch.Tensor,
    tiling: AttentionTiling,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every new token over its request's context in the paged cache, or over its
    `sliding_window` latest positions (its own included); block table entries before the window of a
    tile's first query are never read.

    query [num_tokens, num_heads, head_dim]; kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
    already holding this step's keys and values; tile_map from `build_tile_map` with
    `tiling.block_q(num_heads // num_kv_heads)`. Returns out [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, kv_block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not match kv_cache {tuple(kv_cache.shape)}: head_dim must be "
            "equal and num_heads a multiple of num_kv_heads"
        )
    if head_dim > MAX_HEAD_DIM or head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}, got {head_dim}")
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query and kv_cache must be contiguous in head_dim")
    check_device(query, kv_cache, block_tables, seq_lens, query_start_loc, tile_map)
    queries_per_kv = num_heads // num_kv_heads
    block_q = tiling.block_q(queries_per_kv)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    head_dim_padded = triton.next_power_of_2(head_dim)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if tiling.num_splits > 1:
        partial_out = torch.empty(
            (num_tokens, num_heads, tiling.num_splits, head_dim_padded),
            dtype=torch.float32,
            device=query.device,
        )
        partial_lse = torch.empty(
            (num_tokens, num_heads, tiling.num_splits), dtype=torch.float32, device=query.device
        )
    else:
        partial_out = partial_lse = out  # never read nor written when not splitting
    grid = (tile_map.shape[0], num_kv_heads, tiling.num_splits)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_map,
        scale * math.log2(math.e),
        _NO_WINDOW if sliding_window is None else sliding_window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        KV_BLOCK_SIZE=kv_block_size,
        BLOCK_M=tiling.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=tiling.block_n,
        NUM_SPLITS=tiling.num_splits,
        UPCAST_DOTS=upcast_bf16_dots(query.dtype),
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if tiling.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            NUM_SPLITS=tiling.num_splits,
            num_warps=4,
        )
    return out
