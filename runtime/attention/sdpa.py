"""Batched paged attention on torch's scaled_dot_product_attention: the fast path on CPU, portable to GPU.

Decodes (one new token) run as a few padded batches: their context blocks are gathered whole, and the query
heads that share a KV head are laid out as that head's queries, so grouped-query attention needs no copies of
K/V. Prefill chunks run one SDPA call each: plain causal when nothing is cached before them, else over their
gathered context with a causal mask shifted by the cached length. All index tensors and masks are built once
per step in `prepare` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.reference import write_kv_cache

# Decodes are split into at most this many length buckets, each padded to its own longest context.
_MAX_DECODE_BUCKETS = 4
# A bucket split must save at least this many padded context tokens: about what the extra gather and SDPA
# calls of a bucket cost on a CPU core, per layer.
_MIN_TOKENS_SAVED_PER_SPLIT = 512


@dataclass
class DecodeBucket:
    token_indices: torch.Tensor  # int64 [n]: rows of the step's query
    block_ids: torch.Tensor  # int64 [n * num_blocks]: each request's blocks, padded
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size]: 0 where visible, -inf past seq_len
    num_blocks: int


@dataclass
class PrefillChunk:
    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # int64 [ceil(seq_len / block_size)], None when nothing is cached
    mask: torch.Tensor | None  # bool [q_len, seq_len] when a prefix is cached


@dataclass
class SdpaPlan:
    slot_mapping: torch.Tensor
    decode_buckets: list[DecodeBucket]
    prefill_chunks: list[PrefillChunk]


class SdpaAttentionBackend(AttentionBackend):
    name = "sdpa"

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if spec.num_heads % spec.num_kv_heads:
            return "num_heads must be a multiple of num_kv_heads"
        return None

    def prepare(self, metadata: AttentionMetadata) -> SdpaPlan:
        starts = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        decodes = [i for i in range(metadata.num_reqs) if starts[i + 1] - starts[i] == 1]
        prefills = [i for i in range(metadata.num_reqs) if starts[i + 1] - starts[i] > 1]
        block_tables = metadata.block_tables.long()
        return SdpaPlan(
            slot_mapping=metadata.slot_mapping,
            decode_buckets=[
                self._decode_bucket(bucket, starts, seq_lens, block_tables)
                for bucket in _split_by_length(decodes, seq_lens, self.spec.block_size)
            ],
            prefill_chunks=[self._prefill_chunk(i, starts, seq_lens, block_tables) for i in prefills],
        )

    def _decode_bucket(
        self, reqs: list[int], starts: list[int], seq_lens: list[int], block_tables: torch.Tensor
    ) -> DecodeBucket:
        spec = self.spec
        device = block_tables.device
        num_blocks = -(-max(seq_lens[i] for i in reqs) // spec.block_size)
        req_index = torch.tensor(reqs, dtype=torch.long, device=device)
        block_ids = block_tables.index_select(0, req_index)[:, :num_blocks].reshape(-1)
        lens = torch.tensor([seq_lens[i] for i in reqs], device=device)
        visible = torch.arange(num_blocks * spec.block_size, device=device)[None, :] < lens[:, None]
        mask = torch.zeros(visible.shape, dtype=spec.dtype, device=device).masked_fill_(
            ~visible, float("-inf")
        )
        return DecodeBucket(
            token_indices=torch.tensor([starts[i] for i in reqs], dtype=torch.long, device=device),
            block_ids=block_ids,
            mask=mask[:, None, None, :],
            num_blocks=num_blocks,
        )

    def _prefill_chunk(
        self, i: int, starts: list[int], seq_lens: list[int], block_tables: torch.Tensor
    ) -> PrefillChunk:
        start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
        query_len = end - start
        if seq_len == query_len:
            return PrefillChunk(start, end, seq_len, None, None)
        device = block_tables.device
        block_ids = block_tables[i, : -(-seq_len // self.spec.block_size)]
        query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_positions[:, None]
        return PrefillChunk(start, end, seq_len, block_ids, mask)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: SdpaPlan,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, plan.slot_mapping)
        output = torch.empty_like(query)
        for bucket in plan.decode_buckets:
            output.index_copy_(0, bucket.token_indices, self._decode(query, kv_cache, bucket))
        for chunk in plan.prefill_chunks:
            output[chunk.start : chunk.end] = self._prefill(query, key, value, kv_cache, chunk)
        return output

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket) -> torch.Tensor:
        spec = self.spec
        num_reqs = bucket.token_indices.shape[0]
        group = spec.num_heads // spec.num_kv_heads
        context = bucket.num_blocks * spec.block_size
        # [n, kv_heads, group, dim]: a KV head's query heads act as that head's queries.
        q = query.index_select(0, bucket.token_indices).view(
            num_reqs, spec.num_kv_heads, group, spec.head_dim
        )
        shape = (num_reqs, context, spec.num_kv_heads, spec.head_dim)
        k = _gather_blocks(kv_cache[0], bucket.block_ids).view(shape)
        v = _gather_blocks(kv_cache[1], bucket.block_ids).view(shape)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bucket.mask, scale=spec.scale
        )
        return out.reshape(num_reqs, spec.num_heads, spec.head_dim)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        spec = self.spec
        q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.block_ids is None:
            k = key[chunk.start : chunk.end]
            v = value[chunk.start : chunk.end]
        else:
            shape = (-1, spec.num_kv_heads, spec.head_dim)
            k = _gather_blocks(kv_cache[0], chunk.block_ids).view(shape)[: chunk.seq_len]
            v = _gather_blocks(kv_cache[1], chunk.block_ids).view(shape)[: chunk.seq_len]
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=spec.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )
        return out[0].transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The listed blocks of a [num_blocks, block_size, kv_heads, dim] cache, one flattened row per block.

    Indexing a two-dimensional view copies whole blocks at once, several times faster than the 4-D tensor.
    """
    return cache.view(cache.shape[0], -1).index_select(0, block_ids)


def _split_by_length(reqs: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Sort decodes by context length and cut where padding to one bucket's longest would waste most.

    Each cut is placed greedily where it saves the most padded tokens, and kept only if the saving pays for
    another round of kernel calls in every layer.
    """
    if not reqs:
        return []
    ordered = sorted(reqs, key=lambda i: seq_lens[i])
    padded = [-(-seq_lens[i] // block_size) * block_size for i in ordered]
    buckets = [(0, len(ordered))]
    while len(buckets) < _MAX_DECODE_BUCKETS:
        best_saving, best_cut = 0, None
        for b, (lo, hi) in enumerate(buckets):
            whole = (hi - lo) * padded[hi - 1]
            for cut in range(lo + 1, hi):
                saving = whole - (cut - lo) * padded[cut - 1] - (hi - cut) * padded[hi - 1]
                if saving > best_saving:
                    best_saving, best_cut = saving, (b, cut)
        if best_cut is None or best_saving < _MIN_TOKENS_SAVED_PER_SPLIT:
            break
        b, cut = best_cut
        lo, hi = buckets[b]
        buckets[b : b + 1] = [(lo, cut), (cut, hi)]
    return [ordered[lo:hi] for lo, hi in buckets]
