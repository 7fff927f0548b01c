"""Kernel tests run on the CPU through Triton's interpreter, which tests/conftest.py chooses before any test
module is imported (TRITON_INTERPRET=1)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from kvfleet.runtime.attention.backend import AttentionMetadata
from kvfleet.runtime.kernels import torch_reference


@pytest.fixture(autouse=True)
def kernels_are_interpreted() -> None:
    from kvfleet.runtime.kernels import paged_attention
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(paged_attention._paged_attention_kernel, InterpretedFunction):
        pytest.fail("kernel modules were imported before TRITON_INTERPRET=1 was set; they would need a GPU")
    from triton.language import standard

    if not isinstance(standard.sum, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: its own kernels are compiled")


@dataclass
class PagedBatch:
    """One step of a paged batch: the new tokens' query/key/value and a cache holding every request's
    cached prefix (the new tokens' K/V are written only by `write_new_tokens`)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata

    def write_new_tokens(self) -> None:
        torch_reference.write_kv_cache(self.key, self.value, self.kv_cache, self.metadata.slot_mapping)

    def reference_attention(self, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        metadata = self.metadata
        return torch_reference.paged_attention(
            self.query,
            self.kv_cache,
            block_tables=metadata.block_tables,
            seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
        )

    def poison_blocks_before_windows(self, window: int) -> int:
        """Fill with NaN each block that lies wholly before every window of its request's new tokens, as a
        freed and reused block would hold anything; returns how many."""
        metadata = self.metadata
        block_size = self.kv_cache.shape[2]
        poisoned = 0
        for request, seq_len in enumerate(metadata.seq_lens_cpu):
            query_len = metadata.query_start_loc_cpu[request + 1] - metadata.query_start_loc_cpu[request]
            first_visible = max(0, seq_len - query_len - window + 1)
            for block in range(first_visible // block_size):
                self.kv_cache[:, int(metadata.block_tables[request, block])] = float("nan")
                poisoned += 1
        return poisoned


@pytest.fixture
def make_paged_batch() -> Callable[..., PagedBatch]:
    """Returns a builder of random paged batches: (cached tokens, new tokens) per request, physical blocks
    shuffled, unused blocks and table padding pointing at NaN-filled blocks, and optionally the first
    `shared_prefix_blocks` blocks of request 0 reused by every other request (prefix-cache hits)."""

    def build(
        requests: list[tuple[int, int]],
        *,
        num_kv_heads: int,
        queries_per_kv: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int = 0,
        shared_prefix_blocks: int = 0,
    ) -> PagedBatch:
        generator = torch.Generator().manual_seed(seed)
        shuffle = random.Random(seed)
        seq_lens = [cached + new for cached, new in requests]
        blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
        for cached, _ in requests:
            assert shared_prefix_blocks * block_size <= cached, "shared blocks must hold cached tokens only"
        num_unique = sum(blocks_needed) - shared_prefix_blocks * (len(requests) - 1)
        num_blocks = num_unique + 3  # a few blocks nobody owns: they stay NaN
        physical = list(range(num_blocks))
        shuffle.shuffle(physical)
        poison_block = physical.pop()
        tables: list[list[int]] = []
        for request, needed in enumerate(blocks_needed):
            shared = tables[0][:shared_prefix_blocks] if request else []
            tables.append(shared + [physical.pop() for _ in range(needed - len(shared))])
        max_blocks = max(blocks_needed) + 1
        block_tables = torch.full((len(requests), max_blocks), poison_block, dtype=torch.int32)
        for request, table in enumerate(tables):
            block_tables[request, : len(table)] = torch.tensor(table, dtype=torch.int32)

        def random_kv(num_tokens: int) -> torch.Tensor:
            return torch.randn((num_tokens, num_kv_heads, head_dim), generator=generator).to(dtype)

        kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        written: set[int] = set()
        new_slots: list[int] = []
        for (cached, new), table in zip(requests, tables, strict=True):
            slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(cached)]
            fresh = torch.tensor([slot for slot in slots if slot not in written], dtype=torch.int64)
            torch_reference.write_kv_cache(random_kv(len(fresh)), random_kv(len(fresh)), kv_cache, fresh)
            written.update(slots)
            new_slots.extend(
                table[position // block_size] * block_size + position % block_size
                for position in range(cached, cached + new)
            )
        query_start_loc = [0]
        for _, new in requests:
            query_start_loc.append(query_start_loc[-1] + new)
        num_tokens = query_start_loc[-1]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
            max_query_len=max(new for _, new in requests),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        query = torch.randn((num_tokens, num_kv_heads * queries_per_kv, head_dim), generator=generator)
        return PagedBatch(query.to(dtype), random_kv(num_tokens), random_kv(num_tokens), kv_cache, metadata)

    return build


TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Returns a check that every element is within the output dtype's tolerance of the expected value,
    relative to the largest expected magnitude (so near-zero elements are not held to a ratio)."""

    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        assert not actual.isnan().any(), "output holds NaN"
        rel = TOLERANCE[actual.dtype]
        expected = expected.to(torch.float64)
        scale = expected.abs().max().item()
        torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rel, atol=rel * scale)

    return check
