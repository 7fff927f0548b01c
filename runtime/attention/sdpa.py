"""Batched paged attention on torch's scaled_dot_product_attention: the fast path on CPU, portable to GPU.

Decodes (one new token) are sorted by context length and cut into groups whose gathered K/V fit in the
CPU's cache: each group gathers its context blocks whole (padded to the group's longest context, which
sorting keeps short) and runs one SDPA call, with the query heads that share a KV head laid out as that
head's queries, so grouped-query attention needs no copies of K/V; a step of decodes alone that fit one
group (small batches) skips the sorting and takes the query rows as they are. Prefill chunks run one SDPA
call each: plain causal when nothing is cached before them, else over their gathered context with a causal
mask shifted by the cached length. All index tensors and masks are built once per step in `prepare` and
reused by every layer; layers with a sliding window share another set, built by the first of them.

On the CPU, decodes take a C++ kernel instead when it builds (cpu_decode.py): it reads each decode's
context from the paged cache in place, with no gathered copy and no padding, two to three times as fast
per layer on decode batches of 8 to 36 requests (docs/benchmarks.md).

A request whose context is longer than `long_context_tokens` (a decode or a prefill chunk) never gathers its
whole context: its queries attend over the context in KV tiles of `kv_tile_tokens`, gathered one at a time;
each tile's output and log-sum-exp are merged into running ones (split-KV, in float32), so the memory per
step is O(query tokens x tile) whatever the context's length. A tile is attended only by the queries that
see some of its keys, tiles wholly before the window are skipped, and only tiles that some of their queries
may not wholly see carry a mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.cpu_decode import cpu_kernel_supports_head_size, load_paged_decode_attention
from kvfleet.runtime.attention.reference import write_kv_cache

# Gathered K+V bytes per decode group. On a CPU, a group that stays in L2/L3 between the gather and the
# SDPA call runs several times faster than one big padded batch; on a GPU, fewer launches matter more.
_CPU_DECODE_GROUP_BYTES = 2 << 20
_GPU_DECODE_GROUP_BYTES = 1 << 30
# Long contexts still share a group with a few others, so that per-call overhead stays small next to the work.
_MIN_DECODE_GROUP_ROWS = 4
# Contexts up to this many tokens take the one-call SDPA paths, which batch many decodes in one call and whose
# masks (chunk x context) stay small there; longer ones attend in KV tiles of _KV_TILE_TOKENS, as fast on the
# CPU in measurements from 4K to 32K tokens (docs/long-context.md).
_LONG_CONTEXT_TOKENS = 8192
_KV_TILE_TOKENS = 4096


@dataclass
class DecodeGroup:
    start: int  # rows [start, end) of the step's decodes in context-length order
    end: int
    block_ids: torch.Tensor  # int64 [rows * num_blocks]: each request's blocks, padded
    mask: torch.Tensor  # [rows, 1, 1, num_blocks * block_size]: 0 where visible, -inf past seq_len
    num_blocks: int


@dataclass
class KernelDecodes:
    """The decodes the CPU kernel attends over the paged cache, longest context first (the kernel's threads
    take them in this order, so that a long one is not left for last)."""

    rows: torch.Tensor  # int32: each decode's query row
    requests: torch.Tensor  # int32: its request, a row of block_tables and seq_lens


@dataclass
class PrefillChunk:
    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # int64 [ceil(seq_len / block_size)], None when nothing is cached
    mask: torch.Tensor | None  # bool [q_len, seq_len] when a prefix is cached


@dataclass
class KvTile:
    block_ids: torch.Tensor  # int64: the tile's blocks, in context order
    num_tokens: int  # the tile's context positions (its last block may be partly filled)
    first_row: int  # the request's query rows [first_row, end_row) see some of the tile's keys
    end_row: int
    # [end_row - first_row, num_tokens]: 0 where a query sees a key, -inf where not; None when all see all.
    mask: torch.Tensor | None


@dataclass
class TiledRequest:
    start: int  # the request's query rows [start, end)
    end: int
    tiles: list[KvTile]


@dataclass
class SdpaPlan:
    slot_mapping: torch.Tensor
    # int64: query rows of the decodes, in context-length order; None when the step is only decodes that
    # share one group, which then takes the query rows as they are.
    decode_token_indices: torch.Tensor | None
    decode_groups: list[DecodeGroup]
    kernel_decodes: KernelDecodes | None
    prefill_chunks: list[PrefillChunk]
    # Requests whose context is longer than long_context_tokens, decodes and prefill chunks alike.
    tiled_requests: list[TiledRequest]
    metadata: AttentionMetadata
    # The same step's plans for sliding-window layers, by window.
    windowed: dict[int, SdpaPlan] = field(default_factory=dict)


class SdpaAttentionBackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        bytes_per_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        group_bytes = _GPU_DECODE_GROUP_BYTES if spec.device.type == "cuda" else _CPU_DECODE_GROUP_BYTES
        self.decode_group_tokens = max(group_bytes // bytes_per_token, spec.block_size)
        self.long_context_tokens = _LONG_CONTEXT_TOKENS
        self.kv_tile_tokens = _KV_TILE_TOKENS
        self._attention_with_lse = (
            _fused_attention_with_lse if spec.device.type == "cpu" else _attention_with_lse
        )
        # None: decodes gather their blocks into groups and run SDPA.
        self.decode_kernel = (
            load_paged_decode_attention()
            if spec.device.type == "cpu" and cpu_kernel_supports_head_size(spec.head_dim)
            else None
        )

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if spec.num_heads % spec.num_kv_heads:
            return "num_heads must be a multiple of num_kv_heads"
        return None

    def prepare(self, metadata: AttentionMetadata) -> SdpaPlan:
        return self._plan(metadata, None)

    def _plan(self, metadata: AttentionMetadata, window: int | None) -> SdpaPlan:
        starts = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        long = [i for i in range(metadata.num_reqs) if seq_lens[i] > self.long_context_tokens]
        short = [i for i in range(metadata.num_reqs) if seq_lens[i] <= self.long_context_tokens]
        decodes = sorted((i for i in short if starts[i + 1] - starts[i] == 1), key=seq_lens.__getitem__)
        prefills = [i for i in short if starts[i + 1] - starts[i] > 1]
        block_tables = metadata.block_tables.long()
        device = block_tables.device
        decode_token_indices = None
        groups: list[DecodeGroup] = []
        kernel_decodes = None
        if decodes and self.decode_kernel is not None:
            kernel_decodes = KernelDecodes(
                rows=torch.tensor([starts[i] for i in reversed(decodes)], dtype=torch.int32),
                requests=torch.tensor(decodes[::-1], dtype=torch.int32),
            )
        elif decodes and not prefills and not long and self._fits_one_group(len(decodes), max(seq_lens)):
            # Nothing to reorder: the batch's block tables and lengths, in query order, make the one group.
            lens = metadata.seq_lens.long()
            groups = [self._decode_group(0, len(decodes), block_tables, lens, max(seq_lens), window)]
        elif decodes:
            decode_token_indices = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device)
            decode_block_tables = block_tables.index_select(0, torch.tensor(decodes, device=device))
            decode_lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
            groups = [
                self._decode_group(
                    start, end, decode_block_tables, decode_lens, seq_lens[decodes[end - 1]], window
                )
                for start, end in self._group_bounds([seq_lens[i] for i in decodes])
            ]
        return SdpaPlan(
            slot_mapping=metadata.slot_mapping,
            decode_token_indices=decode_token_indices,
            decode_groups=groups,
            kernel_decodes=kernel_decodes,
            prefill_chunks=[self._prefill_chunk(i, starts, seq_lens, block_tables, window) for i in prefills],
            tiled_requests=[self._tiled_request(i, starts, seq_lens, block_tables, window) for i in long],
            metadata=metadata,
        )

    def _fits_one_group(self, rows: int, longest: int) -> bool:
        padded = -(-longest // self.spec.block_size) * self.spec.block_size
        return rows <= _MIN_DECODE_GROUP_ROWS or rows * padded <= self.decode_group_tokens

    def _group_bounds(self, sorted_lens: list[int]) -> list[tuple[int, int]]:
        """Cut ascending context lengths into runs whose padded size stays within the group budget."""
        bounds = []
        start = 0
        for end in range(1, len(sorted_lens) + 1):
            if not self._fits_one_group(end - start, sorted_lens[end - 1]):
                bounds.append((start, end - 1))
                start = end - 1
        bounds.append((start, len(sorted_lens)))
        return bounds

    def _decode_group(
        self,
        start: int,
        end: int,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        longest: int,
        window: int | None,
    ) -> DecodeGroup:
        spec = self.spec
        num_blocks = -(-longest // spec.block_size)
        block_ids = block_tables[start:end, :num_blocks].reshape(-1)
        context = torch.arange(num_blocks * spec.block_size, device=lens.device)
        hidden = context[None, :] >= lens[start:end, None]
        if window is not None:
            hidden |= context[None, :] < lens[start:end, None] - window
        mask = torch.zeros(hidden.shape, dtype=spec.dtype, device=lens.device).masked_fill_(
            hidden, float("-inf")
        )
        return DecodeGroup(start, end, block_ids, mask[:, None, None, :], num_blocks)

    def _prefill_chunk(
        self, i: int, starts: list[int], seq_lens: list[int], block_tables: torch.Tensor, window: int | None
    ) -> PrefillChunk:
        start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
        query_len = end - start
        windowed = window is not None and window < seq_len
        if seq_len == query_len and not windowed:
            return PrefillChunk(start, end, seq_len, None, None)
        device = block_tables.device
        block_ids = None if seq_len == query_len else block_tables[i, : -(-seq_len // self.spec.block_size)]
        query_positions = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
        key_positions = torch.arange(seq_len, device=device)[None, :]
        mask = key_positions <= query_positions
        if windowed:
            mask &= key_positions > query_positions - window
        return PrefillChunk(start, end, seq_len, block_ids, mask)

    def _tiled_request(
        self, i: int, starts: list[int], seq_lens: list[int], block_tables: torch.Tensor, window: int | None
    ) -> TiledRequest:
        start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
        query_len = end - start
        first_query = seq_len - query_len
        block_size = self.spec.block_size
        tile_blocks = max(self.kv_tile_tokens // block_size, 1)
        # The first block any query may see: blocks before it may already be freed and are never read.
        first_block = 0 if window is None else max(0, first_query - window + 1) // block_size
        num_blocks = -(-seq_len // block_size)
        device = block_tables.device
        tiles = []
        for tile_start in range(first_block, num_blocks, tile_blocks):
            tile_end = min(tile_start + tile_blocks, num_blocks)
            first_key, end_key = tile_start * block_size, min(tile_end * block_size, seq_len)
            # The queries that see at least one of the tile's keys: a contiguous run of rows, so that no row
            # of a tile's attention is wholly masked (its log-sum-exp would be -inf).
            first_row = max(0, first_key - first_query)
            end_row = query_len if window is None else min(query_len, end_key - 1 + window - first_query)
            if first_row >= end_row:
                continue
            mask = None
            # Every one of those rows sees the whole tile when the tile ends at or before the first of them
            # and (with a window) starts within the last one's window.
            last_query = first_query + end_row - 1
            if end_key - 1 > first_query + first_row or (
                window is not None and first_key <= last_query - window
            ):
                query_positions = torch.arange(first_query + first_row, last_query + 1, device=device)[
                    :, None
                ]
                key_positions = torch.arange(first_key, end_key, device=device)[None, :]
                hidden = key_positions > query_positions
                if window is not None:
                    hidden |= key_positions <= query_positions - window
                mask = torch.zeros(hidden.shape, dtype=self.spec.dtype, device=device).masked_fill_(
                    hidden, float("-inf")
                )
            tiles.append(
                KvTile(block_tables[i, tile_start:tile_end], end_key - first_key, first_row, end_row, mask)
            )
        return TiledRequest(start, end, tiles)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: SdpaPlan,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, plan.slot_mapping)
        if sliding_window is not None:
            if sliding_window not in plan.windowed:
                plan.windowed[sliding_window] = self._plan(plan.metadata, sliding_window)
            plan = plan.windowed[sliding_window]
        if plan.decode_token_indices is None and plan.decode_groups:
            return self._decode(query, kv_cache, plan.decode_groups[0])
        output = torch.empty_like(query)
        if plan.kernel_decodes is not None:
            self.decode_kernel(
                output,
                query,
                kv_cache[0],
                kv_cache[1],
                plan.metadata.block_tables,
                plan.metadata.seq_lens,
                plan.kernel_decodes.rows,
                plan.kernel_decodes.requests,
                self.spec.scale,
                sliding_window or 0,
            )
        if plan.decode_token_indices is not None:
            decode_query = query.index_select(0, plan.decode_token_indices)
            decode_output = torch.empty_like(decode_query)
            for group in plan.decode_groups:
                decode_output[group.start : group.end] = self._decode(decode_query, kv_cache, group)
            output.index_copy_(0, plan.decode_token_indices, decode_output)
        for chunk in plan.prefill_chunks:
            output[chunk.start : chunk.end] = self._prefill(query, key, value, kv_cache, chunk)
        for request in plan.tiled_requests:
            output[request.start : request.end] = self._attend_in_tiles(query, kv_cache, request)
        return output

    def _decode(self, decode_query: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        spec = self.spec
        rows = group.end - group.start
        # [rows, kv_heads, group, dim]: a KV head's query heads act as that head's queries.
        q = decode_query[group.start : group.end].view(rows, spec.num_kv_heads, -1, spec.head_dim)
        shape = (rows, group.num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        k = _gather_blocks(kv_cache[0], group.block_ids).view(shape)
        v = _gather_blocks(kv_cache[1], group.block_ids).view(shape)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=spec.scale
        )
        return out.reshape(rows, spec.num_heads, spec.head_dim)

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

    def _attend_in_tiles(
        self, query: torch.Tensor, kv_cache: torch.Tensor, request: TiledRequest
    ) -> torch.Tensor:
        """Each tile's attention with its log-sum-exp, merged into a running output and log-sum-exp: the
        output of rows r is the tiles' outputs weighted by exp(tile's lse - merged lse)."""
        spec = self.spec
        q = query[request.start : request.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        output = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        log_sum_exp = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        shape = (-1, spec.num_kv_heads, spec.head_dim)
        for tile in request.tiles:
            k = _gather_blocks(kv_cache[0], tile.block_ids).view(shape)[: tile.num_tokens]
            v = _gather_blocks(kv_cache[1], tile.block_ids).view(shape)[: tile.num_tokens]
            rows = slice(tile.first_row, tile.end_row)
            tile_output, tile_lse = self._attention_with_lse(
                q[:, :, rows],
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                tile.mask,
                spec.scale,
            )
            previous_lse = log_sum_exp[:, :, rows]
            merged_lse = torch.logaddexp(previous_lse, tile_lse)
            previous_weight = (previous_lse - merged_lse).exp_().unsqueeze(-1)
            tile_weight = (tile_lse - merged_lse).exp_().unsqueeze(-1)
            output[:, :, rows] = output[:, :, rows] * previous_weight + tile_output.float() * tile_weight
            log_sum_exp[:, :, rows] = merged_lse
        return output[0].transpose(0, 1).to(query.dtype)


def _fused_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v and the rows' float32 log-sum-exp of those scores, for q
    [1, heads, rows, dim] and k, v [1, kv_heads, tokens, dim] (a KV head serves consecutive query heads).
    Every row must see at least one key.

    This is torch's fused CPU flash-attention kernel, the one scaled_dot_product_attention runs on the CPU
    (which returns the log-sum-exp too), several times faster there than the same sums as separate operations.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What _fused_attention_with_lse computes, written out in float32 for devices other than the CPU."""
    heads, rows, dim = q.shape[1:]
    # [1, kv_heads, group, rows, tokens]: each KV head's query heads broadcast against it, without copies.
    scores = torch.matmul(
        q.float().reshape(1, k.shape[1], -1, rows, dim), k.float().unsqueeze(2).transpose(-1, -2)
    )
    scores.mul_(scale)
    if mask is not None:
        scores.add_(mask.float())
    lse = scores.logsumexp(-1)
    output = torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_(), v.float().unsqueeze(2))
    return output.view(1, heads, rows, dim), lse.view(1, heads, rows)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The listed blocks of a [num_blocks, block_size, kv_heads, dim] cache, one flattened row per block.

    Indexing a two-dimensional view copies whole blocks at once, several times faster than the 4-D tensor.
    """
    return cache.view(cache.shape[0], -1).index_select(0, block_ids)
