"""KV-cache events on the wire, in vLLM's format, so that kvfleet's replicas and vLLM's are read alike by
kvfleet's gateway, Dynamo's KV router and llm-d's scheduler.

A replica publishes on a ZeroMQ PUB socket multipart messages `[topic, sequence number, payload]`: the
number is 8 bytes big-endian, one more for each batch, from 0 when the publisher starts; the payload is a
msgpack `KVEventBatch` (kvfleet.runtime.kv_events.wire holds the structs). Its replay socket (ROUTER)
answers a request `[b"", start sequence number]` with one message `[b"", topic, sequence number, payload]` per
batch it still holds from that number on, then `[b"", b"", END_OF_REPLAY, b""]`: the layout of recent vLLM
releases (earlier ones sent no topic frame, `[b"", sequence number, payload]`, which readers also accept).

The batch is an array `[ts, events, data_parallel_rank]`. vLLM has encoded its events two ways: as arrays
of their fields after the tag (`["BlockStored", block_hashes, ...]`: earlier releases, and the subscriber
example it published with them), and as maps with a "type" tag (recent releases, among them the 0.32 this
project measures against, whose own decoder refuses the arrays). A publisher takes either (`ENCODINGS`,
"map" by default); a reader takes both.

Block hashes are `kvfleet.contract.block_hash.external_block_hash` of the engine's hashes. `medium` names
where a block is held: MEDIUM_DEVICE is the engine's own KV cache (vLLM's word "GPU", which its CPU build
also publishes), MEDIUM_HOST the host-memory tier a device block spills to.
"""

from __future__ import annotations

from typing import Literal, get_args

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"

DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = get_args(Encoding)


def encode_sequence(number: int) -> bytes:
    return number.to_bytes(8, "big")


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
