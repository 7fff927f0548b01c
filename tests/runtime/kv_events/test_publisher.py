"""The KV events publisher on its own: its queue drops the oldest batch when full, a drop shows as a gap in
the sequence numbers, and --kv-events-config is read as vLLM's (bad values refused with a clear message)."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_events.publisher import (
    DropOldestQueue,
    NullEventPublisher,
    QueuedBatch,
    ZmqEventPublisher,
    make_event_publisher,
)
from kvfleet.runtime.kv_events.wire import AllBlocksCleared, BlockStored
from ports import free_port
from vllm_kv_events import ExampleBatch, KVEventBatch


def test_a_full_queue_drops_its_oldest_batch_and_counts_it() -> None:
    queue = DropOldestQueue(2)
    for sequence in range(5):
        queue.put(QueuedBatch(sequence, b"", 1))
    assert [batch.sequence for batch in queue.take_all()] == [3, 4]
    assert queue.dropped == 3
    assert queue.take_all() == []
    queue.put(QueuedBatch(5, b"", 1))
    assert [batch.sequence for batch in queue.take_all()] == [5]
    assert queue.dropped == 3


def test_batches_handed_over_faster_than_sent_leave_gaps_that_match_the_drops() -> None:
    port = free_port()
    config = KVEventsConfig.parse(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "max_queue_size": 1}
    )
    publisher = ZmqEventPublisher(config)
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.setsockopt(zmq.RCVHWM, 0)
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    received: list[int] = []
    try:
        # The subscription reaches the publisher some time after the connection: probe until it has.
        probes = 0
        while not subscriber.poll(20):
            publisher.publish([AllBlocksCleared()])
            probes += 1
        burst = 2000
        for _ in range(burst):
            publisher.publish([AllBlocksCleared(), AllBlocksCleared()])
        publisher.shutdown()  # sends what is still queued
        while subscriber.poll(1000):
            _, sequence, payload = subscriber.recv_multipart()
            if int.from_bytes(sequence, "big") >= probes:
                received.append(int.from_bytes(sequence, "big"))
                assert len(msgspec.msgpack.decode(payload)[1]) == 2
    finally:
        publisher.shutdown()
        context.destroy(linger=0)
    assert received == sorted(set(received))
    assert received[-1] == probes + burst - 1, "the newest batch is never dropped"
    assert len(received) < burst, "the burst outran the publisher thread"
    # Every batch was either sent (and, past the probes, received) or dropped: the gaps are the drops.
    probes_sent = publisher.events_published - 2 * len(received)
    assert publisher.batches_dropped == (probes - probes_sent) + (burst - len(received))


def test_bad_replay_requests_are_ignored_and_good_ones_answered() -> None:
    events_port, replay_port = free_port(), free_port()
    config = KVEventsConfig.parse(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "buffer_steps": 2,
            "topic": "kv",
        }
    )
    publisher = ZmqEventPublisher(config)
    context = zmq.Context()
    hostile, client = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    for socket in (hostile, client):
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        for _ in range(3):
            publisher.publish([AllBlocksCleared()])
        # Oversized last: the publisher drops the connection that sends it.
        for bad in (
            [b"", b"\x00\x01"],
            [b"x", (0).to_bytes(8, "big")],
            [(0).to_bytes(8, "big")],
            [b"", b"a" * 5000],
        ):
            hostile.send_multipart(bad)
        client.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []
        while True:
            assert client.poll(10_000), "no answer to a good request"
            answers.append(client.recv_multipart())
            if answers[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
        # Only the last two batches are kept, each after the topic as vLLM sends them.
        assert [int.from_bytes(answer[2], "big") for answer in answers[:-1]] == [1, 2]
        assert all(answer[1] == config.topic.encode() for answer in answers[:-1])
        assert answers[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert publisher.batches_replayed == 2
        with pytest.raises(ValueError, match=f"cannot open tcp://\\*:{events_port}"):
            ZmqEventPublisher(config)
    finally:
        publisher.shutdown()
        context.destroy(linger=0)


@pytest.mark.parametrize(("encoding", "batch_type"), [("map", KVEventBatch), ("array", ExampleBatch)])
def test_each_encoding_is_read_by_the_vllm_structs_of_its_time(encoding: str, batch_type: type) -> None:
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "encoding": encoding}
    publisher = ZmqEventPublisher(KVEventsConfig.parse(config))
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    stored = BlockStored([7, 8], 6, [1, 2, 3, 4], 2, 5, "GPU", "tenant-x")
    try:
        while not subscriber.poll(20):
            publisher.publish([stored])
        batch = msgspec.msgpack.Decoder(batch_type).decode(subscriber.recv_multipart()[2])
    finally:
        publisher.shutdown()
        context.destroy(linger=0)
    (event,) = batch.events
    assert (event.block_hashes, event.parent_block_hash, event.token_ids) == ([7, 8], 6, [1, 2, 3, 4])
    assert (event.block_size, event.lora_id, event.medium) == (2, 5, "GPU")
    assert getattr(event, "lora_name", "tenant-x") == "tenant-x"


def test_the_null_publisher_is_bound_when_events_are_off() -> None:
    assert isinstance(make_event_publisher(None), NullEventPublisher)
    assert isinstance(make_event_publisher(KVEventsConfig.parse("{}")), NullEventPublisher)
    disabled = KVEventsConfig.parse({"enable_kv_cache_events": False, "publisher": "zmq"})
    assert isinstance(make_event_publisher(disabled), NullEventPublisher)


def test_the_config_reads_vllm_s_fields() -> None:
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:7000", '
        '"replay_endpoint": "tcp://*:7001", "topic": "kv", "buffer_steps": 5, "hwm": 6, "max_queue_size": 7}'
    )
    assert config.publisher == "zmq" and config.publishes
    assert (config.endpoint, config.replay_endpoint, config.topic) == (
        "tcp://10.0.0.1:7000",
        "tcp://*:7001",
        "kv",
    )
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (5, 6, 7)
    defaults = KVEventsConfig.parse({"enable_kv_cache_events": True})
    assert (defaults.endpoint, defaults.replay_endpoint) == ("tcp://*:5557", None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
        ({"publisher": "kafka"}, "publisher must be one of null, zmq"),
        ({"endpoint": "localhost:5557"}, "endpoint must be a ZeroMQ endpoint"),
        ({"replay_endpoint": 5558}, "replay_endpoint must be a ZeroMQ endpoint"),
        ({"buffer_steps": 0}, "buffer_steps must be a positive integer"),
        ({"max_queue_size": True}, "max_queue_size must be a positive integer"),
        ({"topic": 1}, "topic must be a string"),
        ({"encoding": "json"}, "encoding must be one of map, array"),
        ({"endpiont": "tcp://*:1"}, "does not take endpiont"),
    ],
)
def test_bad_values_are_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(value)  # type: ignore[arg-type]
