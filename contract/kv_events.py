"""KV-cache events on the wire, in vLLM's format, so that kvfleet's replicas and vLLM's are read alike by
kvfleet's gateway, Dynamo's KV router and llm-d's scheduler.

A replica publishes on a ZeroMQ PUB socket multipart messages `[topic, sequence number, payload]`: the
number is 8 bytes big-endian, one more for each batch, from 0 when the publisher starts; the payload is a
msgpack `KVEventBatch`. Its replay socket (ROUTER) answers a request `[b"", start sequence number]` with one
message `[b"", sequence number, payload]` per batch it still holds from that number on, then
`[b"", END_OF_REPLAY, b""]`.

The batch is an array `[ts, events, data_parallel_rank]`. vLLM has encoded its events two ways: as arrays
of their fields after the tag (`["BlockStored", block_hashes, ...]`: earlier releases, and the subscriber
example it published with them), and as maps with a "type" tag (recent releases, among them the 0.32 this
project measures against, whose own decoder refuses the arrays). A publisher takes either (`ENCODINGS`,
"map" by default); `decode_batch` reads both.

Block hashes are `kvfleet.contract.block_hash.external_block_hash` of the engine's hashes. `medium` names
where a block is held: MEDIUM_DEVICE is the engine's own KV cache (vLLM's word "GPU", which its CPU build
also publishes), MEDIUM_HOST the host-memory tier a device block spills to.

Unlike the rest of the contract, this module needs msgspec: the structs are the format.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"

DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = get_args(Encoding)


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


def encode_sequence(number: int) -> bytes:
    return number.to_bytes(8, "big")


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
