"""KV-cache events on the wire, in vLLM's format, so that kvfleet's replicas and vLLM's are read alike by
kvfleet's gateway, Dynamo's KV router and llm-d's scheduler.

A replica publishes on a ZeroMQ PUB socket multipart messages `[topic, sequence number, payload]`: the
number is 8 bytes big-endian, one more for each batch, from 0 when the publisher starts; the payload is a
msgpack `KVEventBatch`. Its replay socket (ROUTER) answers a request `[b"", start sequence number]` with one
message `[b"", sequence number, payload]` per batch it still holds from that number on, then
`[b"", END_OF_REPLAY, b""]`.

Block hashes are `kvfleet.contract.block_hash.external_block_hash` of the engine's hashes. `medium` names
where a block is held: MEDIUM_DEVICE is the engine's own KV cache (vLLM's word "GPU", which its CPU build
also publishes), MEDIUM_HOST the host-memory tier a device block spills to.

Unlike the rest of the contract, this module needs msgspec: the structs are the format.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"

DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Tagged by class name, as vLLM's are."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one prompt, now cached: `parent_block_hash` is the block before the first one
    (None at the start of a chain), `token_ids` their tokens, block after block."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of every medium is gone (the prefix cache was reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def encode_sequence(number: int) -> bytes:
    return number.to_bytes(8, "big")


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
