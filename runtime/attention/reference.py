"""Paged attention written for clarity, one request at a time: the yardstick the fast backends are tested
against, not a serving path."""

from __future__ import annotations

from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each new token's key and value at its slot (block id * block_size + offset)."""
    # Two-dimensional views: torch copies whole rows then, several times faster than with more dimensions.
    row = kv_cache.shape[-2] * kv_cache.shape[-1]
    kv_cache[0].view(-1, row).index_copy_(0, slot_mapping, key.reshape(-1, row))
    kv_cache[1].view(-1, row).index_copy_(0, slot_mapping, value.reshape(-1, row))


class ReferenceAttentionBackend(AttentionBackend):
    name = "reference"

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if spec.num_heads % spec.num_kv_heads:
            return "num_heads must be a multiple of num_kv_heads"
        return None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: Any,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        metadata: AttentionMetadata = plan
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        spec = self.spec
        group = spec.num_heads // spec.num_kv_heads
        output = torch.empty_like(query)
        for i in range(metadata.num_reqs):
            start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            # The context this request's queries may see: from the first query's window on.
            first_visible = (
                0 if sliding_window is None else max(0, seq_len - (end - start) - sliding_window + 1)
            )
            positions = torch.arange(first_visible, seq_len, device=query.device)
            slots = metadata.block_tables[i].long()[positions // spec.block_size] * spec.block_size
            slots += positions % spec.block_size
            keys = (
                kv_cache[0].flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
            )  # [seq, heads, dim]
            values = kv_cache[1].flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
            q = query[start:end].float()  # [new, heads, dim]
            scores = torch.matmul(q.transpose(0, 1), keys.permute(1, 2, 0)) * spec.scale  # [heads, new, seq]
            # The new tokens are the last `end - start` of the context: token j sees positions <= its own.
            query_positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
            visible = positions[None, :] <= query_positions[:, None]
            if sliding_window is not None:
                visible &= positions[None, :] > query_positions[:, None] - sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            attended = torch.matmul(scores.softmax(dim=-1), values.transpose(0, 1))  # [heads, new, dim]
            output[start:end] = attended.transpose(0, 1).to(query.dtype)
        return output
