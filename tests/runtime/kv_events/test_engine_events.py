"""The engine's KV-cache events read the way any consumer of vLLM's would: a plain ZeroMQ subscriber with
msgspec structs shaped as recent vLLM's (events as maps with a "type" tag: tests/vllm_kv_events.py), not
kvfleet's.

One offline engine for the module, with a device cache of 12 blocks of 8 tokens and a host tier of a few
blocks, so that prompts evict, spill and drop blocks. The oracles: the block-hash rule of the contract on the
prompts' tokens, and the engine's own prefix cache, which an index rebuilt from the events must equal.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from kvfleet.contract.block_hash import block_hashes, chain_seed, external_block_hash
from kvfleet.runtime import LLM, SamplingParams
from ports import free_port
from vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BLOCK_SIZE = 8
TOPIC = "kv-test"
OPTIONS = {
    "dtype": "float32",
    "num_gpu_blocks_override": 12,
    "block_size": BLOCK_SIZE,
    "max_model_len": 96,
    "max_num_batched_tokens": 64,
}
GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1)
decoder = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """Every batch received, by sequence number."""

    def __init__(self, context: zmq.Context, port: int) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.batches: dict[int, tuple[bytes, KVEventBatch]] = {}

    def receive(self, until: Callable[[], bool], timeout: float = 10.0) -> None:
        """Take what arrives until `until()` holds."""
        deadline = time.monotonic() + timeout
        while not until():
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the awaited events did not arrive"
            if self.socket.poll(remaining * 1000):
                topic, sequence, payload = self.socket.recv_multipart()
                assert topic == TOPIC.encode()
                self.batches[int.from_bytes(sequence, "big")] = (payload, decoder.decode(payload))

    def events(self, since: int = 0) -> list[Any]:
        return [
            event for seq in sorted(self.batches) if seq >= since for event in self.batches[seq][1].events
        ]

    @property
    def next_sequence(self) -> int:
        return max(self.batches, default=-1) + 1


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def subscriber(context: zmq.Context, ports: tuple[int, int]) -> Subscriber:
    return Subscriber(context, ports[0])


@pytest.fixture(scope="module")
def llm(make_model: Callable[..., Path], ports: tuple[int, int], subscriber: Subscriber) -> Iterator[LLM]:
    events_port, replay_port = ports
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
    }
    # 12 KiB: a host tier of about six blocks of the tiny model.
    host_tier = 12 / 2**20
    llm = LLM(
        str(make_model("llama", "tiny")), kv_offloading_size=host_tier, kv_events_config=config, **OPTIONS
    )
    # What is sent before the subscription reaches the publisher is lost to the subscriber: a reset (an event
    # at once) until one arrives.
    deadline = time.monotonic() + 10
    while not subscriber.socket.poll(0):
        assert time.monotonic() < deadline, "the subscriber never received an event"
        llm.reset_prefix_cache()
        subscriber.socket.poll(100)
    subscriber.receive(lambda: bool(subscriber.batches))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(16, 1000) for _ in range(length)]


def _expected_hashes(tokens: list[int], cache_salt: str | None = None) -> list[int]:
    seed = chain_seed(cache_salt=cache_salt)
    return [external_block_hash(h) for h in block_hashes(tokens, BLOCK_SIZE, seed)]


def _stored(events: list[Any], medium: str) -> list[BlockStored]:
    return [event for event in events if isinstance(event, BlockStored) and event.medium == medium]


def _generate(
    llm: LLM, subscriber: Subscriber, prompts: list[Any]
) -> tuple[list[Any], tuple[set[int], set[int]]]:
    """Run the prompts, then reset the prefix cache: the events of their steps, and what the engine's two
    tiers held before the reset (as external hashes)."""
    since = subscriber.next_sequence
    llm.generate(prompts, GREEDY_ONE)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.host_kv_tier is not None
    cached = (
        {external_block_hash(h) for h in scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block},
        {external_block_hash(h) for h in scheduler.host_kv_tier._prefix},
    )
    return _fence(llm, subscriber, since), cached


def _fence(llm: LLM, subscriber: Subscriber, since: int) -> list[Any]:
    """Every event from batch `since` on: a reset's AllBlocksCleared, sent after them, marks their end."""
    llm.reset_prefix_cache()
    subscriber.receive(lambda: AllBlocksCleared() in subscriber.events(since))
    events = subscriber.events(since)
    assert events[-1] == AllBlocksCleared()
    return events[:-1]


def _index(events: list[Any]) -> tuple[set[int], set[int]]:
    """What a router would believe each tier holds, from the events alone."""
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held = {"GPU": set(), "CPU": set()}
        elif isinstance(event, BlockStored):
            held[event.medium].update(event.block_hashes)
        else:
            assert held[event.medium].issuperset(event.block_hashes), "removed before it was stored"
            held[event.medium].difference_update(event.block_hashes)
    return held["GPU"], held["CPU"]


def test_a_prompt_s_full_blocks_are_stored_with_their_tokens_and_parents(
    llm: LLM, subscriber: Subscriber
) -> None:
    # Longer than a step's budget: its blocks are stored over two steps, the second run after the first.
    prompt = _prompt(random.Random(1), 10 * BLOCK_SIZE + 3)
    events, cached = _generate(llm, subscriber, [prompt])
    stored = _stored(events, "GPU")
    assert len(stored) == 2
    assert [h for event in stored for h in event.block_hashes] == _expected_hashes(prompt)
    assert [t for event in stored for t in event.token_ids] == prompt[: 10 * BLOCK_SIZE]
    assert stored[0].parent_block_hash is None
    for previous, event in itertools.pairwise(stored):
        assert event.parent_block_hash == previous.block_hashes[-1]
    assert all(
        event.block_size == BLOCK_SIZE and event.lora_id is event.lora_name is None for event in stored
    )
    assert all(len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes) for event in stored)
    assert _index(events) == cached


def test_evictions_spills_and_host_drops_leave_an_index_equal_to_the_engine_s_cache(
    llm: LLM, subscriber: Subscriber
) -> None:
    rng = random.Random(2)
    events, cached = _generate(llm, subscriber, [_prompt(rng, 4 * BLOCK_SIZE + 1) for _ in range(6)])
    removed = {
        medium: [
            h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes
        ]
        for medium in ("GPU", "CPU")
    }
    assert removed["GPU"] and removed["CPU"], "the workload evicts from both tiers"
    # A spilled block is announced with the tokens and parent it was stored with on the device.
    announced = {
        block_hash: (
            event.parent_block_hash if index == 0 else event.block_hashes[index - 1],
            event.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE],
        )
        for event in _stored(events, "GPU")
        for index, block_hash in enumerate(event.block_hashes)
    }
    spills = _stored(events, "CPU")
    assert spills
    for spill in spills:
        (block_hash,) = spill.block_hashes
        assert (spill.parent_block_hash, spill.token_ids) == announced[block_hash]
    assert _index(events) == cached


def test_tenants_with_different_salts_never_share_a_block(llm: LLM, subscriber: Subscriber) -> None:
    prompt = _prompt(random.Random(3), 3 * BLOCK_SIZE + 2)
    stored = {}
    for salt in ("tenant-a", "tenant-b", None):
        request = (
            {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        )
        events, _ = _generate(llm, subscriber, [request])
        stored[salt] = [h for event in _stored(events, "GPU") for h in event.block_hashes]
        assert stored[salt] == _expected_hashes(prompt, salt)
    assert not set(stored["tenant-a"]) & set(stored["tenant-b"])
    assert not set(stored[None]) & (set(stored["tenant-a"]) | set(stored["tenant-b"]))
    # The engine's own lookups agree: a salt finds its own blocks, never another's.
    since = subscriber.next_sequence
    requests = [
        {"prompt_token_ids": prompt, "cache_salt": salt} for salt in ("tenant-a", "tenant-a", "tenant-c")
    ]
    outputs = [llm.generate([request], GREEDY_ONE)[0] for request in requests]
    assert [output.num_cached_tokens for output in outputs] == [0, 3 * BLOCK_SIZE, 0]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], GREEDY_ONE)
    _fence(llm, subscriber, since)


def test_a_reset_clears_all_blocks(llm: LLM, subscriber: Subscriber) -> None:
    since = subscriber.next_sequence
    llm.generate([_prompt(random.Random(4), 2 * BLOCK_SIZE)], GREEDY_ONE)
    llm.reset_prefix_cache()
    subscriber.receive(lambda: AllBlocksCleared() in subscriber.events(since))
    # The reset's batch holds nothing else.
    assert subscriber.batches[subscriber.next_sequence - 1][1].events == [AllBlocksCleared()]
    assert _index(subscriber.events(since)) == (set(), set())


def test_a_late_subscriber_replays_what_it_missed(
    llm: LLM, subscriber: Subscriber, context: zmq.Context, ports: tuple[int, int]
) -> None:
    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(f"tcp://127.0.0.1:{ports[1]}")
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed: dict[int, bytes] = {}
    while True:
        assert replay.poll(10_000), "the replay socket did not answer"
        empty, _, sequence, payload = replay.recv_multipart()
        assert empty == b""
        if sequence == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed[int.from_bytes(sequence, "big")] = payload
    replay.close()
    # Every batch since the engine started, numbered from 0 without a gap, byte for byte what was published.
    assert sorted(replayed) == list(range(subscriber.next_sequence))
    assert all(replayed[seq] == payload for seq, (payload, _) in subscriber.batches.items())
    stats = llm.llm_engine.engine_core.stats
    assert stats.kv_event_batches_replayed == len(replayed)
    assert stats.kv_events_published == sum(
        len(decoder.decode(payload).events) for payload in replayed.values()
    )
    assert stats.kv_event_batches_dropped == 0
