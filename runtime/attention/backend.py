"""The contract every attention backend implements.

KV cache layout (one tensor per layer, shared by all backends):
    kv_cache[0] = keys, kv_cache[1] = values, each [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives in slot block_table[p // block_size] * block_size + p % block_size.

A step's query is flattened: the new tokens of every scheduled request, request after request
(prefill chunks, with or without a cached prefix, and single-token decodes mixed freely).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend must support: fixed for the life of an engine."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the model runner and shared by every layer."""

    # int32 [num_reqs + 1]: request i's query tokens are query[query_start_loc[i]:query_start_loc[i + 1]].
    query_start_loc: torch.Tensor
    # int32 [num_reqs]: context length of request i after this step (cached tokens + new tokens).
    seq_lens: torch.Tensor
    # int32 [num_reqs, max_blocks]: physical block ids; entries past a request's last block are padding.
    block_tables: torch.Tensor
    # int64 [num_tokens]: the cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens, for decisions that must not sync with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache, then attends causally over each request's context, or
    over its `sliding_window` latest positions (the query's own included) for layers that have one. Blocks
    wholly before every query's window may have been freed: their block table entries must not be read."""

    name: ClassVar[str]

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        """None if this backend can run `spec`, else a short reason it cannot (logged by the selector)."""

    def prepare(self, metadata: AttentionMetadata) -> Any:
        """Per-step work shared by all layers (index tensors, masks); its result is passed to `forward`."""
        return metadata

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: Any,  # what `prepare` returned for this step
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value at the step's slots, then return the attention output for every query token."""
