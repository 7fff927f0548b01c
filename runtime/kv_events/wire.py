"""KV-cache events' structs and their msgpack encodings (the protocol is kvfleet.contract.kv_events): vLLM's
`KVEventBatch` and its tagged events, written as maps (recent vLLM) or as arrays (earlier vLLM and the
subscriber example it published), and read in either.

The engine's publisher writes them and the gateway reads them; neither needs torch, so the gateway imports
this module alone.
"""

from __future__ import annotations

from typing import Any

import msgspec
from kvfleet.contract.kv_events import Encoding


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Tagged by class name, as vLLM's are."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one prompt, now cached: `parent_block_hash` is the block before the first one
    (None at the start of a chain), `token_ids` their tokens, block after block. `lora_name` is the adapter's
    (vLLM routes LoRA on it), `lora_id` the engine's number for it. `extra_keys`, vLLM's: for each block,
    what its hash covers besides its tokens (None: nothing); kvfleet's hashes carry their own."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of every medium is gone (the prefix cache was reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int]
    medium: str | None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    pass


class _ArrayKVEventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


_map_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_ArrayKVEventBatch)


def encode_batch(batch: KVEventBatch, encoding: Encoding = "map") -> bytes:
    if encoding == "map":
        return _map_encoder.encode(batch)
    return _map_encoder.encode(
        _ArrayKVEventBatch(batch.ts, [_to_array(event) for event in batch.events], batch.data_parallel_rank)
    )


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in either encoding; msgspec.DecodeError (a ValidationError among them) for anything else."""
    try:
        return _map_decoder.decode(payload)
    except msgspec.ValidationError:
        legacy = _array_decoder.decode(payload)
    return KVEventBatch(legacy.ts, [_from_array(event) for event in legacy.events], legacy.data_parallel_rank)


def _to_array(event: KVEvent) -> _ArrayEvent:
    if isinstance(event, BlockStored):
        return _ArrayBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, BlockRemoved):
        return _ArrayBlockRemoved(event.block_hashes, event.medium)
    return _ArrayAllBlocksCleared()


def _from_array(event: Any) -> KVEvent:
    if isinstance(event, _ArrayBlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            lora_name=None,
        )
    if isinstance(event, _ArrayBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()
