"""vLLM's side of `make kv-events-vs-vllm`: subscribes to a replica's KV events and decodes every batch with
vLLM's own classes (`vllm.distributed.kv_events`), printing each event as a JSON line.

Runs in vLLM's own environment, never in kvfleet's. Prints `{"ready": true}` once subscribed, then one line
per event: `{"seq": N, "type": "BlockStored", ...fields}`; a batch vLLM cannot decode is printed as
`{"seq": N, "error": "..."}`.

    python -P bench/vllm/kv_events_subscriber.py --endpoint tcp://127.0.0.1:5557 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(args.endpoint)
    # A SUB socket receives only what is published after its subscription has reached the publisher.
    time.sleep(1.0)
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            if not socket.poll(100):
                continue
            _, sequence, payload = socket.recv_multipart()
            number = int.from_bytes(sequence, "big")
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as error:
                print(json.dumps({"seq": number, "error": str(error)}), flush=True)
                continue
            for event in batch.events:
                fields = {name: getattr(event, name) for name in event.__struct_fields__}
                print(json.dumps({"seq": number, "type": type(event).__name__, **fields}), flush=True)
    finally:
        socket.close(linger=0)
        context.term()


if __name__ == "__main__":
    main()
