"""The reference and SDPA paged-attention backends against dense causal attention on random inputs.

The SDPA backend runs its decodes through the CPU decode kernel unless a test switches to its gather path
(the path of hosts that cannot build the kernel, and of GPUs).

Each case mixes, in one step: decodes, prefills with nothing cached, prefill chunks after a cached prefix,
and requests whose first blocks are shared (a prefix-cache hit); block tables are shuffled across the pool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.reference import ReferenceAttentionBackend
from kvfleet.runtime.attention.sdpa import (
    SdpaAttentionBackend,
    _attention_with_lse,
    _fused_attention_with_lse,
)

NUM_HEADS = 8
HEAD_DIM = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 4096


@dataclass
class Sequence:
    """One request: K/V of its whole context (cached part + new tokens) and its new tokens' queries."""

    keys: torch.Tensor  # [seq_len, kv_heads, dim]
    values: torch.Tensor
    queries: torch.Tensor  # [new, heads, dim]
    block_ids: list[int]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[0]

    @property
    def num_new(self) -> int:
        return self.queries.shape[0]


def _spec(num_kv_heads: int) -> AttentionSpec:
    return AttentionSpec(NUM_HEADS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))


def _make_step(
    num_kv_heads: int, shapes: list[tuple[int, int]], seed: int, shared_prefix_blocks: int = 0
) -> tuple[list[Sequence], torch.Tensor]:
    """shapes: (cached tokens, new tokens) per request. Returns the sequences and a KV cache holding every
    request's cached tokens at its (shuffled) blocks. With shared_prefix_blocks, the first two requests
    share that many leading blocks (same K/V, same physical blocks)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)  # garbage elsewhere
    sequences: list[Sequence] = []
    for i, (cached, new) in enumerate(shapes):
        seq_len = cached + new
        keys = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        values = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        num_blocks = -(-seq_len // BLOCK_SIZE)
        if i == 1 and shared_prefix_blocks:
            shared = shared_prefix_blocks * BLOCK_SIZE
            assert cached >= shared and sequences[0].seq_len - sequences[0].num_new >= shared
            keys[:shared] = sequences[0].keys[:shared]
            values[:shared] = sequences[0].values[:shared]
            block_ids = sequences[0].block_ids[:shared_prefix_blocks]
            block_ids += [free.pop() for _ in range(num_blocks - shared_prefix_blocks)]
        else:
            block_ids = [free.pop() for _ in range(num_blocks)]
        positions = torch.arange(cached)
        slots = torch.tensor(block_ids)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        flat = cache.view(2, -1, num_kv_heads, HEAD_DIM)
        flat[0, slots] = keys[:cached]
        flat[1, slots] = values[:cached]
        queries = torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen)
        sequences.append(Sequence(keys, values, queries, block_ids))
    return sequences, cache


def _metadata(sequences: list[Sequence]) -> AttentionMetadata:
    starts = [0]
    for s in sequences:
        starts.append(starts[-1] + s.num_new)
    width = max(len(s.block_ids) for s in sequences) + 2  # padding past every table's end
    tables = torch.zeros(len(sequences), width, dtype=torch.int32)
    slots = []
    for i, s in enumerate(sequences):
        tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
        for position in range(s.seq_len - s.num_new, s.seq_len):
            slots.append(s.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    seq_lens = [s.seq_len for s in sequences]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(s.num_new for s in sequences),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def _dense_causal(sequences: list[Sequence], num_kv_heads: int, window: int | None = None) -> torch.Tensor:
    """Plain softmax(QK^T / sqrt(d)) V in float64 over each whole context, query j seeing keys <= its own
    (and, with a window, only the `window` latest of them)."""
    outputs = []
    group = NUM_HEADS // num_kv_heads
    for s in sequences:
        keys = s.keys.double().repeat_interleave(group, dim=1)
        values = s.values.double().repeat_interleave(group, dim=1)
        scores = torch.matmul(s.queries.double().transpose(0, 1), keys.permute(1, 2, 0)) / HEAD_DIM**0.5
        query_positions = torch.arange(s.seq_len - s.num_new, s.seq_len)
        key_positions = torch.arange(s.seq_len)[None, :]
        visible = key_positions <= query_positions[:, None]
        if window is not None:
            visible &= key_positions > query_positions[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.matmul(scores.softmax(-1), values.transpose(0, 1)).transpose(0, 1))
    return torch.cat(outputs).float()


def _sdpa_gathering_decodes(spec: AttentionSpec) -> SdpaAttentionBackend:
    backend = SdpaAttentionBackend(spec)
    backend.decode_kernel = None
    return backend


def _run(
    backend: AttentionBackend, sequences: list[Sequence], cache: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    num_kv_heads = backend.spec.num_kv_heads
    metadata = _metadata(sequences)
    plan = backend.prepare(metadata)
    query = torch.cat([s.queries for s in sequences])
    new_keys = torch.cat([s.keys[s.seq_len - s.num_new :] for s in sequences])
    new_values = torch.cat([s.values[s.seq_len - s.num_new :] for s in sequences])
    output = backend.forward(query, new_keys, new_values, cache, plan, sliding_window=window)
    # The new tokens' K/V are in the cache at their slots afterwards.
    flat = cache.view(2, -1, num_kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat[0, metadata.slot_mapping], new_keys)
    torch.testing.assert_close(flat[1, metadata.slot_mapping], new_values)
    return output


MIXED_STEP = [(12, 1), (16, 4), (0, 9), (20, 6), (7, 1), (0, 1), (33, 1), (5, 11)]


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize(
    "backend_class", [ReferenceAttentionBackend, SdpaAttentionBackend, _sdpa_gathering_decodes]
)
def test_mixed_step_matches_dense_attention(backend_class, num_kv_heads: int) -> None:
    sequences, cache = _make_step(num_kv_heads, MIXED_STEP, seed=num_kv_heads, shared_prefix_blocks=3)
    expected = _dense_causal(sequences, num_kv_heads)
    output = _run(backend_class(_spec(num_kv_heads)), sequences, cache.clone())
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_backends_agree_on_many_decodes_of_varied_length(num_kv_heads: int) -> None:
    # Context lengths from 1 to ~300 make the SDPA backend split decodes into several padded groups.
    rng = random.Random(num_kv_heads)
    shapes = [(rng.randrange(0, 300), 1) for _ in range(48)] + [(0, 13), (9, 8)]
    sequences, cache = _make_step(num_kv_heads, shapes, seed=100 + num_kv_heads)
    backend = _sdpa_gathering_decodes(_spec(num_kv_heads))
    backend.decode_group_tokens = 1024  # several groups even with few KV heads
    plan = backend.prepare(_metadata(sequences))
    assert len(plan.decode_groups) > 2
    assert [(g.start, g.end) for g in plan.decode_groups][-1][1] == 48
    assert plan.decode_token_indices is not None
    assert sorted(plan.decode_token_indices.tolist()) == list(range(48))
    reference = _run(ReferenceAttentionBackend(_spec(num_kv_heads)), sequences, cache.clone())
    fast = _run(backend, sequences, cache.clone())
    torch.testing.assert_close(fast, reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast, _dense_causal(sequences, num_kv_heads), atol=2e-5, rtol=1e-4)


def test_only_prefills_and_only_decodes() -> None:
    for shapes in ([(0, 5), (0, 17), (8, 3)], [(3, 1), (0, 1), (40, 1)]):
        sequences, cache = _make_step(2, shapes, seed=len(shapes[0]))
        output = _run(SdpaAttentionBackend(_spec(2)), sequences, cache)
        torch.testing.assert_close(output, _dense_causal(sequences, 2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_decodes", [3, 40])
def test_decode_only_steps_in_one_group_keep_the_query_order(num_decodes: int) -> None:
    rng = random.Random(num_decodes)
    sequences, cache = _make_step(2, [(rng.randrange(0, 300), 1) for _ in range(num_decodes)], seed=7)
    backend = _sdpa_gathering_decodes(_spec(2))
    backend.decode_group_tokens = 1024  # 3 decodes fit one group, 40 do not
    plan = backend.prepare(_metadata(sequences))
    if num_decodes == 3:
        assert len(plan.decode_groups) == 1 and plan.decode_token_indices is None
    else:
        assert len(plan.decode_groups) > 1 and plan.decode_token_indices is not None
    output = _run(backend, sequences, cache)
    torch.testing.assert_close(output, _dense_causal(sequences, 2), atol=2e-5, rtol=1e-4)


# Long contexts against short tiles: decodes and prefill chunks (cached or not) whose
# contexts end mid-tile and mid-block, beside short requests that keep the one-call paths.
LONG_STEP = [(150, 1), (45, 1), (90, 23), (0, 61), (3, 1), (7, 5), (120, 1)]


@pytest.mark.parametrize("backend_class", [SdpaAttentionBackend, _sdpa_gathering_decodes])
@pytest.mark.parametrize("window", [None, 13, 40])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_long_contexts_attend_in_kv_tiles(backend_class, num_kv_heads: int, window: int | None) -> None:
    sequences, cache = _make_step(num_kv_heads, LONG_STEP, seed=50 + num_kv_heads, shared_prefix_blocks=2)
    backend = backend_class(_spec(num_kv_heads))
    backend.long_context_tokens = 40
    backend.kv_tile_tokens = 12
    plan = backend.prepare(_metadata(sequences))
    assert [(r.start, r.end) for r in plan.tiled_requests] == [(0, 1), (1, 2), (2, 25), (25, 86), (92, 93)]
    if window is None:
        # 151 tokens in tiles of 12: 13 tiles, of which only the last may hide anything from a decode.
        assert len(plan.tiled_requests[0].tiles) == 13
        assert all(tile.mask is None for tile in plan.tiled_requests[0].tiles)
    output = _run(backend, sequences, cache, window)
    torch.testing.assert_close(output, _dense_causal(sequences, num_kv_heads, window), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_written_out_tile_attention_matches_the_fused_kernel(num_kv_heads: int) -> None:
    # The CPU runs the fused kernel; other devices the written-out sums: both give the same output and lse.
    gen = torch.Generator().manual_seed(num_kv_heads)
    # Query rows as the backend passes them: a slice of the step's [tokens, heads, dim] query, transposed.
    q = torch.randn(12, NUM_HEADS, HEAD_DIM, generator=gen).transpose(0, 1).unsqueeze(0)[:, :, 3:]
    k = torch.randn(1, num_kv_heads, 21, HEAD_DIM, generator=gen)
    v = torch.randn(1, num_kv_heads, 21, HEAD_DIM, generator=gen)
    hidden = torch.arange(21)[None, :] > torch.arange(12, 21)[:, None]
    mask = torch.zeros(9, 21).masked_fill_(hidden, float("-inf"))
    for tile_mask in (None, mask):
        fused = _fused_attention_with_lse(q, k, v, tile_mask, 0.3)
        written_out = _attention_with_lse(q, k, v, tile_mask, 0.3)
        torch.testing.assert_close(written_out, fused, atol=2e-5, rtol=1e-4)
        scores = q @ k.repeat_interleave(NUM_HEADS // num_kv_heads, 1).transpose(-1, -2) * 0.3
        if tile_mask is not None:
            scores = scores + tile_mask
        torch.testing.assert_close(written_out[1], scores.logsumexp(-1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 4096])
def test_a_chunk_against_a_128k_context_needs_memory_of_its_tiles_only(window: int | None) -> None:
    # A 2048-token prefill chunk ending at 131072 tokens: every tile gathers at most kv_tile_tokens of KV, and
    # the masks cover the chunk's diagonal (and window edge) only, not the context.
    chunk, context = 2048, 131072
    spec = AttentionSpec(NUM_HEADS, 2, HEAD_DIM, 16, torch.float32, torch.device("cpu"))
    backend = SdpaAttentionBackend(spec)
    tables = torch.arange(context // 16, dtype=torch.int32)[None]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
        seq_lens=torch.tensor([context], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.arange(context - chunk, context),
        max_query_len=chunk,
        max_seq_len=context,
        query_start_loc_cpu=[0, chunk],
        seq_lens_cpu=[context],
    )
    plan = backend.prepare(metadata)
    if window is not None:
        plan = backend._plan(metadata, window)
    assert not plan.prefill_chunks and len(plan.tiled_requests) == 1
    tiles = plan.tiled_requests[0].tiles
    assert all(tile.num_tokens <= backend.kv_tile_tokens for tile in tiles)
    # With a window, the tiles start at the block of the chunk's first visible key.
    first_key = 0 if window is None else (context - chunk - window + 1) // 16 * 16
    assert sum(tile.num_tokens for tile in tiles) == context - first_key
    masked = [tile.mask.numel() for tile in tiles if tile.mask is not None]
    assert len(masked) <= 2 and sum(masked) <= chunk * backend.kv_tile_tokens * 2


def test_tiles_before_the_window_are_never_read() -> None:
    # The decode's blocks before its window hold NaN, as freed blocks may hold anything.
    sequences, cache = _make_step(2, [(300, 1)], seed=3)
    for block in sequences[0].block_ids[: 250 // BLOCK_SIZE]:
        cache[:, block] = float("nan")
    backend = SdpaAttentionBackend(_spec(2))
    backend.long_context_tokens = 40
    backend.kv_tile_tokens = 16
    output = _run(backend, sequences, cache, window=32)
    torch.testing.assert_close(output, _dense_causal(sequences, 2, window=32), atol=2e-5, rtol=1e-4)


def test_unsupported_head_layout_is_reported() -> None:
    spec = AttentionSpec(6, 4, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    assert SdpaAttentionBackend.unsupported_reason(spec) is not None
    assert ReferenceAttentionBackend.unsupported_reason(spec) is not None
    assert SdpaAttentionBackend.unsupported_reason(_spec(2)) is None
