"""vLLM's KV-event structs as vLLM declares them, written here apart from kvfleet's own
(kvfleet.runtime.kv_events.wire), so that a test decoding with these sees any mismatch between the two.

Two encodings: recent vLLM's, events as maps with a "type" tag naming the adapter (`KVEventBatch`), and the
one of earlier vLLM and of the subscriber example it published then, events as arrays (`ExampleBatch`).
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(_Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ExampleEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class ExampleBlockStored(ExampleEvent, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ExampleBlockRemoved(ExampleEvent, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int]
    medium: str | None


class ExampleAllBlocksCleared(ExampleEvent, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    pass


class ExampleBatch(_Batch):
    events: list[ExampleBlockStored | ExampleBlockRemoved | ExampleAllBlocksCleared]
