"""The paged attention kernel against the per-request torch reference, through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.kernels.paged_attention import (
    AttentionTiling,
    build_tile_map,
    choose_num_splits,
    default_tiling,
    paged_attention,
)

# Decode, fresh prefill, prefill chunk over a cached prefix, long decode, short decode.
MIXED_STEP = [(37, 1), (0, 23), (20, 9), (70, 1), (5, 1)]
DECODE_STEP = [(45, 1), (100, 1), (3, 1), (64, 1)]


def run_kernel(
    batch,
    tiling: AttentionTiling | None = None,
    query: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    query = batch.query if query is None else query
    num_heads, head_dim = query.shape[1:]
    queries_per_kv = num_heads // batch.kv_cache.shape[3]
    metadata = batch.metadata
    if tiling is None:
        tiling = default_tiling(
            queries_per_kv=queries_per_kv,
            head_dim=head_dim,
            dtype=query.dtype,
            max_query_len=metadata.max_query_len,
        )
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    returned = paged_attention(
        query,
        batch.kv_cache,
        block_tables=metadata.block_tables,
        seq_lens=metadata.seq_lens,
        query_start_loc=metadata.query_start_loc,
        tile_map=build_tile_map(metadata.query_start_loc_cpu, tiling.block_q(queries_per_kv), query.device),
        tiling=tiling,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
        out=out,
    )
    assert returned is out
    return out


@pytest.mark.parametrize(
    ("queries_per_kv", "num_kv_heads", "head_dim", "block_size", "dtype", "tiling"),
    [
        (1, 2, 64, 16, torch.float32, None),
        (4, 2, 128, 8, torch.float32, None),
        (8, 1, 64, 32, torch.float32, None),
        (4, 2, 64, 4, torch.float32, AttentionTiling(block_m=16, block_n=16)),
        (8, 1, 128, 16, torch.float32, AttentionTiling(block_m=64, block_n=32)),
        (4, 1, 96, 16, torch.float32, None),
        (3, 2, 64, 16, torch.float32, None),  # a group that does not fill a power of two
        (4, 2, 64, 16, torch.bfloat16, None),
        (8, 1, 128, 16, torch.bfloat16, AttentionTiling(block_m=32, block_n=16)),
        (1, 2, 64, 32, torch.float16, None),
    ],
)
def test_mixed_prefill_and_decode_batch_matches_reference(
    make_paged_batch, assert_close, queries_per_kv, num_kv_heads, head_dim, block_size, dtype, tiling
) -> None:
    batch = make_paged_batch(
        MIXED_STEP,
        num_kv_heads=num_kv_heads,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=queries_per_kv * 100 + block_size,
    )
    batch.write_new_tokens()
    assert_close(run_kernel(batch, tiling), batch.reference_attention(head_dim**-0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_decode_matches_reference(make_paged_batch, assert_close, dtype, num_splits) -> None:
    batch = make_paged_batch(
        DECODE_STEP,
        num_kv_heads=2,
        queries_per_kv=4,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=num_splits,
    )
    batch.write_new_tokens()
    # block_n 16 cuts even the 4-token request into ranges, some with no key at all to merge.
    tiling = AttentionTiling(block_m=16, block_n=16, num_splits=num_splits)
    assert_close(run_kernel(batch, tiling), batch.reference_attention(64**-0.5))


def test_split_kv_on_prefill_tiles_matches_reference(make_paged_batch, assert_close) -> None:
    # Ranges before a row's position or past it: rows with nothing to see in a range must weigh zero.
    batch = make_paged_batch(
        MIXED_STEP, num_kv_heads=1, queries_per_kv=4, head_dim=64, block_size=8, dtype=torch.float32, seed=7
    )
    batch.write_new_tokens()
    tiling = AttentionTiling(block_m=16, block_n=16, num_splits=4)
    assert_close(run_kernel(batch, tiling), batch.reference_attention(64**-0.5))


@pytest.mark.parametrize("window", [1, 5, 16, 33, 200])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_never_reads_blocks_before_it(
    make_paged_batch, assert_close, window: int, num_splits: int
) -> None:
    batch = make_paged_batch(
        MIXED_STEP, num_kv_heads=2, queries_per_kv=2, head_dim=64, block_size=4, dtype=torch.float32, seed=9
    )
    poisoned = batch.poison_blocks_before_windows(window)
    assert (poisoned > 0) == (window < 60)
    batch.write_new_tokens()
    tiling = AttentionTiling(block_m=16, block_n=16, num_splits=num_splits)
    out = run_kernel(batch, tiling, sliding_window=window)
    assert_close(out, batch.reference_attention(64**-0.5, sliding_window=window))


def test_prefix_blocks_shared_between_requests(make_paged_batch, assert_close) -> None:
    batch = make_paged_batch(
        [(40, 1), (24, 6), (17, 1)],
        num_kv_heads=2,
        queries_per_kv=4,
        head_dim=64,
        block_size=8,
        dtype=torch.float32,
        seed=3,
        shared_prefix_blocks=2,
    )
    tables = batch.metadata.block_tables
    assert torch.equal(tables[0, :2], tables[1, :2]) and torch.equal(tables[0, :2], tables[2, :2])
    batch.write_new_tokens()
    assert_close(run_kernel(batch), batch.reference_attention(64**-0.5))


def test_query_may_be_a_strided_view_of_a_fused_qkv(make_paged_batch, assert_close) -> None:
    batch = make_paged_batch(
        MIXED_STEP, num_kv_heads=2, queries_per_kv=4, head_dim=64, block_size=16, dtype=torch.float32, seed=5
    )
    batch.write_new_tokens()
    num_tokens, num_heads, head_dim = batch.query.shape
    fused = torch.randn(num_tokens, (num_heads + 4) * head_dim)
    query = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    query.copy_(batch.query)
    assert not query.is_contiguous()
    assert_close(run_kernel(batch, query=query), batch.reference_attention(head_dim**-0.5))


def test_tile_map_covers_every_new_token_once() -> None:
    tile_map = build_tile_map([0, 1, 6, 7, 11], block_q=2, device=torch.device("cpu"))
    assert tile_map.dtype == torch.int32
    assert tile_map.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0], [3, 1]]


def test_tile_map_rejects_a_request_without_new_tokens() -> None:
    with pytest.raises(ValueError, match="at least one new token"):
        build_tile_map([0, 3, 3], block_q=2, device=torch.device("cpu"))


def test_tiling_validation() -> None:
    with pytest.raises(ValueError, match="power of two"):
        AttentionTiling(block_m=24, block_n=16)
    with pytest.raises(ValueError, match="at least 16"):
        AttentionTiling(block_m=8, block_n=16)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionTiling(block_m=16, block_n=16).block_q(32)
    assert AttentionTiling(block_m=64, block_n=16).block_q(6) == 10


def test_default_tiling_puts_a_whole_decode_gqa_group_in_one_tile() -> None:
    decode = default_tiling(queries_per_kv=8, head_dim=128, dtype=torch.bfloat16, max_query_len=1)
    assert (decode.block_m, decode.block_q(8)) == (16, 2)
    prefill = default_tiling(queries_per_kv=8, head_dim=128, dtype=torch.bfloat16, max_query_len=300)
    assert prefill.block_q(8) >= 8
    wide_group = default_tiling(queries_per_kv=32, head_dim=64, dtype=torch.float16, max_query_len=1)
    assert wide_group.block_q(32) == 1


def test_split_count_fills_the_device_only_when_it_is_short_of_programs() -> None:
    assert choose_num_splits(num_programs=512, max_seq_len=4096, block_n=64, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=32768, block_n=64, num_sms=132) == 16
    assert choose_num_splits(num_programs=64, max_seq_len=8192, block_n=64, num_sms=132) == 4
    assert choose_num_splits(num_programs=8, max_seq_len=200, block_n=64, num_sms=132) == 1


def test_an_empty_step_launches_nothing() -> None:
    query = torch.empty(0, 4, 64)
    out = paged_attention(
        query,
        torch.zeros(2, 1, 16, 2, 64),
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        tile_map=build_tile_map([0], block_q=4, device=torch.device("cpu")),
        tiling=AttentionTiling(block_m=16, block_n=16),
        scale=0.125,
    )
    assert out.shape == (0, 4, 64)


def test_mismatched_shapes_are_refused(make_paged_batch) -> None:
    batch = make_paged_batch(
        [(3, 2)], num_kv_heads=2, queries_per_kv=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="does not match kv_cache"):
        run_kernel(batch, query=torch.randn(2, 3, 64))
