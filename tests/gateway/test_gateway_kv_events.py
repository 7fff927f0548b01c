"""The precise-prefix policy's block index, fed by real ZeroMQ sockets: replays, gaps, restarts, hostile
streams, and the choice it makes from what the replicas publish.

The replicas' side is written here with plain zmq and msgspec structs of the tests' own, in the array
encoding of vLLM's published example (tests/vllm_kv_events.py), not kvfleet's classes, so a mismatch shows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import gateway_harness as harness
import msgspec
import pytest
import zmq
import zmq.asyncio
from click.testing import CliRunner
from kvfleet.contract.block_hash import block_hashes, chain_seed, external_block_hash
from kvfleet.gateway import kv_events
from kvfleet.gateway.cli import _event_endpoints, gateway_command
from kvfleet.gateway.kv_events import EventEndpoints, KVEventFeeds
from kvfleet.gateway.kv_index import KVBlockIndex, PrefixMatch
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.routing import CHARS_PER_TOKEN, Decision, PrecisePrefix, Prompt, Replica
from vllm_kv_events import ExampleAllBlocksCleared as Cleared
from vllm_kv_events import ExampleBatch as Batch
from vllm_kv_events import ExampleBlockRemoved as Removed
from vllm_kv_events import ExampleBlockStored as Stored

BLOCK_SIZE = 4


def hashes(tokens: Sequence[int], lora_int_id: int = 0, block_size: int = BLOCK_SIZE) -> list[int]:
    """The engine's external hashes of the prompt's full blocks, by the contract's rule."""
    return [external_block_hash(h) for h in block_hashes(tokens, block_size, chain_seed(lora_int_id))]


def stored(tokens: Sequence[int], medium: str = "GPU", lora_int_id: int = 0) -> Stored:
    return Stored(hashes(tokens, lora_int_id), None, list(tokens), BLOCK_SIZE, lora_int_id or None, medium)


def prompt_of(tokens: Sequence[int], adapter: str | None = None) -> Prompt:
    return Prompt(
        " ".join(map(str, tokens)),
        adapter,
        lambda block_size, lora_int_id: hashes(tokens, lora_int_id, block_size),
    )


class ReplicaEvents:
    """A replica's publisher: XPUB (so the test knows when the gateway has subscribed) and a replay
    ROUTER holding every batch published since `trimmed_before`, answering with the topic frame as recent
    vLLM releases do (`topic_in_replay`) or without it as earlier ones did."""

    def __init__(self, context: zmq.asyncio.Context, topic_in_replay: bool = True) -> None:
        self.publisher = context.socket(zmq.XPUB)
        self.replay = context.socket(zmq.ROUTER)
        for socket in (self.publisher, self.replay):
            socket.setsockopt(zmq.LINGER, 0)
        # Every subscriber's subscription is seen, not only the first of a topic.
        self.publisher.setsockopt(zmq.XPUB_VERBOSE, 1)
        port = self.publisher.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.endpoints = EventEndpoints(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        self.buffer: dict[int, bytes] = {}
        self.sequence = 0
        self.replays_asked: list[int] = []
        self.answer_replays = True
        self._topic = [b""] if topic_in_replay else []
        self._server = asyncio.create_task(self._serve_replays())

    async def subscribed(self) -> None:
        frame = await asyncio.wait_for(self.publisher.recv(), 5)
        assert frame[:1] == b"\x01", "a subscription"

    async def publish(self, *events: Stored | Removed | Cleared, live: bool = True) -> int:
        """Publishes one batch (on the live socket unless `live` is false: a batch the gateway misses)."""
        sequence, self.sequence = self.sequence, self.sequence + 1
        payload = msgspec.msgpack.encode(Batch(time.time(), list(events)))
        self.buffer[sequence] = payload
        if live:
            await self.send(sequence.to_bytes(8, "big"), payload)
        return sequence

    async def send(self, *frames: bytes) -> None:
        await self.publisher.send_multipart([b"", *frames])

    def trim(self, before: int) -> None:
        self.buffer = {seq: payload for seq, payload in self.buffer.items() if seq >= before}

    async def _serve_replays(self) -> None:
        while True:
            identity, _, start = await self.replay.recv_multipart()
            self.replays_asked.append(int.from_bytes(start, "big"))
            if not self.answer_replays:
                continue
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start, "big")):
                answer = [*self._topic, seq.to_bytes(8, "big"), self.buffer[seq]]
                await self.replay.send_multipart([identity, b"", *answer])
            end = [*self._topic, (-1).to_bytes(8, "big", signed=True), b""]
            await self.replay.send_multipart([identity, b"", *end])

    def close(self) -> None:
        self._server.cancel()
        self.publisher.close()
        self.replay.close()


async def until(condition: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


Scenario = Callable[[list[ReplicaEvents], KVEventFeeds, GatewayMetrics], Awaitable[None]]


def run(scenario: Scenario, replicas: int = 1, max_entries: int = 10_000) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        metrics = GatewayMetrics()
        sources = [ReplicaEvents(context) for _ in range(replicas)]
        feeds = KVEventFeeds(
            KVBlockIndex(max_entries),
            metrics.kv_index,
            {url(index): source.endpoints for index, source in enumerate(sources)},
        )
        try:
            feeds.follow([url(index) for index in range(replicas)])
            for source in sources:
                await source.subscribed()
                await until(lambda source=source: bool(source.replays_asked), "the first replay is asked")
            await scenario(sources, feeds, metrics)
        finally:
            await feeds.close()
            for source in sources:
                source.close()
            context.term()

    asyncio.run(main())


def url(index: int) -> str:
    return f"http://127.0.0.{index + 1}:8000"


def held(feeds: KVEventFeeds, replica: int, tokens: Sequence[int]) -> PrefixMatch:
    return feeds.index.match(url(replica), hashes(tokens))


def drops(metrics: GatewayMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("kvfleet_gateway_kv_index_drops_total", {"reason": reason})
    return value or 0.0


PROMPT_A = list(range(100, 116))  # four blocks
PROMPT_B = list(range(200, 208))  # two blocks
PROMPT_C = list(range(300, 312))  # three blocks


def test_a_subscriber_learns_a_running_replicas_cache_by_replay_and_follows_its_events() -> None:
    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        (source,) = sources
        await source.publish(stored(PROMPT_A))
        await until(lambda: held(feeds, 0, PROMPT_A) == PrefixMatch(4, 0), "prompt A is indexed")
        # The last block spills to the host tier and leaves the device; the prompt's start stays there.
        await source.publish(
            stored(PROMPT_A, medium="CPU"), Removed(hashes(PROMPT_A)[3:], "GPU"), stored(PROMPT_B)
        )
        await until(lambda: held(feeds, 0, PROMPT_A) == PrefixMatch(3, 1), "the spill is indexed")
        assert held(feeds, 0, PROMPT_B) == PrefixMatch(2, 0)
        await source.publish(Removed(hashes(PROMPT_A)[1:2], "GPU"), Removed(hashes(PROMPT_A)[1:2], "CPU"))
        await until(lambda: held(feeds, 0, PROMPT_A) == PrefixMatch(1, 0), "the chain is broken at block 1")
        await source.publish(Cleared())
        await until(lambda: len(feeds.index) == 0, "a cache reset clears the replica")
        assert source.replays_asked == [0]

    run(scenario)


@pytest.mark.parametrize("topic_in_replay", [True, False])
def test_a_replica_running_before_the_gateway_is_learnt_from_its_replay(topic_in_replay: bool) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        metrics = GatewayMetrics()
        source = ReplicaEvents(context, topic_in_replay)
        await source.publish(stored(PROMPT_A), live=False)
        await source.publish(stored(PROMPT_B), live=False)
        feeds = KVEventFeeds(KVBlockIndex(), metrics.kv_index, {url(0): source.endpoints})
        try:
            feeds.follow([url(0)])
            await source.subscribed()
            await until(lambda: held(feeds, 0, PROMPT_B).blocks == 2, "the replayed batches are indexed")
            assert held(feeds, 0, PROMPT_A).blocks == 4
            await source.publish(Removed(hashes(PROMPT_B), "GPU"))
            await until(lambda: held(feeds, 0, PROMPT_B).blocks == 0, "live events follow the replay")
            feeds.follow([])
            await until(lambda: len(feeds.index) == 0, "a replica no longer followed is forgotten")
            assert drops(metrics, "replica_removed") == 1
        finally:
            await feeds.close()
            source.close()
            context.term()

    asyncio.run(main())


def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        (source,) = sources
        await source.publish(stored(PROMPT_A))
        await source.publish(stored(PROMPT_B), live=False)
        await source.publish(Removed(hashes(PROMPT_A)[2:], "GPU"), live=False)
        await source.publish(stored(PROMPT_C))
        await until(lambda: held(feeds, 0, PROMPT_C).blocks == 3, "the batch after the gap is indexed")
        assert held(feeds, 0, PROMPT_B).blocks == 2, "the missed store was replayed"
        assert held(feeds, 0, PROMPT_A).blocks == 2, "the missed removal was replayed"
        assert source.replays_asked == [0, 1]
        assert drops(metrics, "unreplayable_gap") == 0

    run(scenario)


def test_a_gap_the_replica_no_longer_holds_drops_its_entries() -> None:
    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        (source,) = sources
        await source.publish(stored(PROMPT_A))
        await until(lambda: held(feeds, 0, PROMPT_A).blocks == 4, "prompt A is indexed")
        # Missed, and gone from the replica's buffer: whether prompt A was evicted meanwhile is unknown.
        await source.publish(Removed(hashes(PROMPT_A), "GPU"), live=False)
        await source.publish(stored(PROMPT_B), live=False)
        source.trim(2)
        await source.publish(stored(PROMPT_C))
        await until(lambda: held(feeds, 0, PROMPT_C).blocks == 3, "the stream goes on")
        assert held(feeds, 0, PROMPT_A).blocks == 0
        assert held(feeds, 0, PROMPT_B).blocks == 2, "what the replay still holds is applied"
        assert drops(metrics, "unreplayable_gap") == 1

    run(scenario)


def test_a_replay_that_never_answers_drops_the_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        # Past the first replay, which a busy machine may answer slowly.
        monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 0.2)
        (source,) = sources
        await source.publish(stored(PROMPT_A))
        await until(lambda: held(feeds, 0, PROMPT_A).blocks == 4, "prompt A is indexed")
        source.answer_replays = False
        await source.publish(stored(PROMPT_B), live=False)
        await source.publish(stored(PROMPT_C))
        await until(lambda: drops(metrics, "replay_timeout") == 1, "the replay timed out")
        await until(lambda: held(feeds, 0, PROMPT_C).blocks == 3, "the stream goes on")
        assert held(feeds, 0, PROMPT_A).blocks == 0

    run(scenario)


def test_a_restarted_replica_is_forgotten_and_relearnt() -> None:
    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        (source,) = sources
        await source.publish(stored(PROMPT_A))
        await source.publish(stored(PROMPT_B))
        await until(lambda: held(feeds, 0, PROMPT_B).blocks == 2, "both prompts are indexed")
        # The replica restarted: its numbers start again from 0, its cache is empty.
        source.sequence, source.buffer = 0, {}
        await source.publish(stored(PROMPT_C))
        await until(lambda: held(feeds, 0, PROMPT_C).blocks == 3, "the new stream is followed")
        assert held(feeds, 0, PROMPT_A).blocks == 0 and held(feeds, 0, PROMPT_B).blocks == 0
        assert drops(metrics, "restarted") == 1

    run(scenario)


def test_a_hostile_stream_drops_only_its_own_replicas_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_BLOCKS_PER_BATCH", 64)

    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        hostile, honest = sources
        await honest.publish(stored(PROMPT_C))
        attacks: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("malformed", lambda: hostile.publisher.send_multipart([b"garbage"])),
            ("malformed", lambda: hostile.send(b"\x00\x01", b"payload")),
            ("undecodable", lambda: hostile.send(hostile.sequence.to_bytes(8, "big"), b"\xc1not msgpack")),
            ("oversized_batch", lambda: hostile.publish(Removed(list(range(65)), "GPU"))),
            ("invalid_batch", lambda: hostile.publish(Stored([1], None, [1], 0, None, "GPU"))),
            ("restarted", lambda: hostile.send((0).to_bytes(8, "big"), b"")),
        ]
        for reason, attack in attacks:
            before = drops(metrics, reason)
            await hostile.publish(stored(PROMPT_A))
            await until(
                lambda: held(feeds, 0, PROMPT_A).blocks == 4, "the hostile replica's blocks are indexed"
            )
            await attack()
            await until(
                lambda reason=reason, count=before + 1: drops(metrics, reason) == count,
                f"the {reason} stream is counted",
            )
            assert held(feeds, 0, PROMPT_A).blocks == 0, reason
            assert held(feeds, 1, PROMPT_C).blocks == 3, "the other replica's entries stay"
            if reason in ("malformed", "undecodable", "restarted"):
                hostile.sequence += 1  # the frame took a number (or the stream must be seen going on)
            hostile.trim(hostile.sequence)
        await honest.publish(stored(PROMPT_B))
        await until(lambda: held(feeds, 1, PROMPT_B).blocks == 2, "the gateway goes on following")

    run(scenario, replicas=2)


def test_a_message_over_the_size_cap_is_a_gap_that_drops_the_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 1024)

    async def scenario(sources: list[ReplicaEvents], feeds: KVEventFeeds, metrics: GatewayMetrics) -> None:
        # Past the first replay, which a busy machine may answer slowly.
        monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 0.2)
        (source,) = sources
        await source.publish(stored(PROMPT_A))
        await until(lambda: held(feeds, 0, PROMPT_A).blocks == 4, "prompt A is indexed")
        # ZeroMQ drops the connection that brings it (and the replay's, that would bring it again).
        await source.publish(Removed([2**63 + n for n in range(200)], "GPU"))
        deadline = time.monotonic() + 5
        while held(feeds, 0, PROMPT_C).blocks < 3:
            assert time.monotonic() < deadline, "the subscriber never came back"
            await source.publish(stored(PROMPT_C))  # until the reconnected subscriber hears one
            await asyncio.sleep(0.05)
        assert held(feeds, 0, PROMPT_A).blocks == 0
        assert drops(metrics, "replay_timeout") == 1

    run(scenario)


def test_the_index_forgets_the_least_recently_stored_blocks_past_its_cap() -> None:
    index = KVBlockIndex(max_entries=6)
    index.store("r0", hashes(PROMPT_A), "GPU", BLOCK_SIZE)
    index.store("r1", hashes(PROMPT_B), "GPU", BLOCK_SIZE)
    assert len(index) == 6
    index.store("r0", hashes(PROMPT_A)[:1], "GPU", BLOCK_SIZE)  # stored again: the most recent now
    index.store("r1", hashes(PROMPT_B)[:1], "CPU", BLOCK_SIZE)  # a second entry for the block
    assert len(index) == 6
    # Out went r0's blocks 1 and 2 (the oldest); block 0 was refreshed, block 3 is past the broken chain.
    assert index.match("r0", hashes(PROMPT_A)) == PrefixMatch(1, 0)
    assert index.match("r1", hashes(PROMPT_B)) == PrefixMatch(2, 0)
    assert index.drop("r1") == 3 and len(index) == 3
    assert index.match("r1", hashes(PROMPT_B)) == PrefixMatch()


def replicas(count: int, *loads: int) -> list[Replica]:
    return [Replica(url(index), loads[index] if loads else 0) for index in range(count)]


def anyone(replica: Replica) -> bool:
    return True


def test_precise_prefix_takes_the_longest_cached_prefix_within_the_load_bound() -> None:
    index = KVBlockIndex()
    index.store(url(0), hashes(PROMPT_A)[:2], "GPU", BLOCK_SIZE)
    index.store(url(1), hashes(PROMPT_A)[:3], "CPU", BLOCK_SIZE)  # 3 host blocks: worth 1.5 device blocks
    index.store(url(2), hashes(PROMPT_A)[:1], "GPU", BLOCK_SIZE)
    decisions: list[Decision] = []
    policy = PrecisePrefix(index, load_bound=1.25, record=decisions.append)
    fleet = replicas(3)
    assert policy.choose(fleet, prompt_of(PROMPT_A), anyone) is fleet[0]
    assert decisions[-1] == Decision("device_hit", PrefixMatch(2, 0))
    assert policy.choose(fleet, prompt_of(PROMPT_A), lambda r: r is not fleet[0]) is fleet[1]
    assert decisions[-1] == Decision("host_hit", PrefixMatch(0, 3))
    # Over the bound (ceil(1.25 * 4 / 3) = 2 with the new request), the best holder is passed over.
    fleet[0].in_flight = 3
    assert policy.choose(fleet, prompt_of(PROMPT_A), anyone) is fleet[1]
    assert decisions[-1].reason == "over_load_bound"
    # Every block held counts for disaggregated prefill, wherever it is held.
    block_chars = BLOCK_SIZE * CHARS_PER_TOKEN
    assert policy.cached_chars(fleet, prompt_of(PROMPT_A)) == {
        url(0): 2 * block_chars,
        url(1): 3 * block_chars,
        url(2): block_chars,
    }
    # A prompt the gateway cannot hash: the least loaded.
    fleet[1].in_flight = 1
    assert policy.choose(fleet, Prompt("text"), anyone) is fleet[2]
    assert decisions[-1].reason == "not_tokenized"


def test_precise_prefix_matches_an_adapters_blocks_by_each_replicas_id() -> None:
    index = KVBlockIndex()
    # The same adapter files give the same id everywhere; replica 1 loaded other files under the name.
    index.store(url(0), hashes(PROMPT_A, lora_int_id=7), "GPU", BLOCK_SIZE)
    index.store(url(1), hashes(PROMPT_A, lora_int_id=9), "GPU", BLOCK_SIZE)
    index.store(url(2), hashes(PROMPT_A), "GPU", BLOCK_SIZE)
    policy = PrecisePrefix(index)
    fleet = replicas(3)
    fleet[0].lora_int_ids = {"support": 7}
    fleet[1].lora_int_ids = {"support": 7}
    assert policy.choose(fleet, prompt_of(PROMPT_A, adapter="support"), anyone) is fleet[0]
    assert policy.choose(fleet, prompt_of(PROMPT_A), anyone) is fleet[2]


def test_two_gateways_fed_the_same_events_route_alike() -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        sources = [ReplicaEvents(context) for _ in range(3)]
        endpoints = {url(index): source.endpoints for index, source in enumerate(sources)}
        gateways = [KVEventFeeds(KVBlockIndex(), GatewayMetrics().kv_index, endpoints) for _ in range(2)]
        try:
            for feeds in gateways:
                feeds.follow(endpoints)
            for source in sources:
                await source.subscribed()
                await source.subscribed()
            # Tenant t's prompt has (t % 5 + 1) blocks, of which replica t % 3 caches up to (t % 3 + 1).
            prompts = [list(range(1000 * t, 1000 * t + BLOCK_SIZE * (t % 5 + 1))) for t in range(30)]
            cached = [tokens[: BLOCK_SIZE * (t % 3 + 1)] for t, tokens in enumerate(prompts)]
            for tenant, tokens in enumerate(cached):
                await sources[tenant % 3].publish(stored(tokens))
            for feeds in gateways:
                index = feeds.index
                await until(
                    lambda index=index: all(
                        index.match(url(t % 3), hashes(c)).blocks for t, c in enumerate(cached)
                    ),
                    "every batch is indexed",
                )
            policies = [PrecisePrefix(feeds.index) for feeds in gateways]
            fleets = [replicas(3), replicas(3)]
            questions = [*prompts, *(list(range(5000 + 8 * n, 5008 + 8 * n)) for n in range(30))]
            # Traffic only the first gateway saw: a choice that hung on its own history would now differ.
            for tokens in questions[::7]:
                policies[0].choose(fleets[0], prompt_of(tokens), anyone)
            chosen = [
                [policy.choose(fleet, prompt_of(tokens), anyone).url for tokens in questions]  # type: ignore[union-attr]
                for policy, fleet in zip(policies, fleets, strict=True)
            ]
            assert chosen[0] == chosen[1]
            assert chosen[0][:30] == [url(t % 3) for t in range(30)], "each prompt goes where it is cached"
            assert len(set(chosen[0][30:])) == 3, "new prefixes spread"
        finally:
            for feeds in gateways:
                await feeds.close()
            for source in sources:
                source.close()
            context.term()

    asyncio.run(main())


def test_the_gateway_follows_its_precise_prefix_replicas_and_serves_through_a_broken_stream() -> None:
    async def through_the_gateway(fleet: Sequence[harness.FakeReplica], sources: list[ReplicaEvents]) -> None:
        endpoints = {replica.url: source.endpoints for replica, source in zip(fleet, sources, strict=True)}
        config = harness.model("m", *fleet, policy="precise-prefix")
        async with harness.running_gateway({"m": config}, kv_events_endpoints=endpoints) as running:
            gateway, discovery, base = running
            for source in sources:
                await source.subscribed()
            index = gateway.fleet.kv_index
            await sources[0].publish(stored(PROMPT_A))
            await sources[1].publish(stored(PROMPT_B))
            await until(lambda: len(index) == 6, "both replicas' blocks are indexed")
            await sources[1].publisher.send_multipart([b"garbage"])
            await until(lambda: len(index) == 4, "the broken stream's replica is dropped")
            async with aiohttp.ClientSession() as session:
                body = {"model": "m", "prompt": "hello", "max_tokens": 1}
                async with session.post(f"{base}/v1/completions", json=body) as response:
                    assert response.status == 200
                async with session.get(f"{base}/metrics") as response:
                    page = await response.text()
            assert 'kvfleet_gateway_kv_index_drops_total{reason="malformed"} 1.0' in page
            assert 'precise_prefix_decisions_total{model="m",reason="not_tokenized"} 1.0' in page
            discovery.publish({"m": harness.model("m", fleet[1], policy="precise-prefix")})
            await until(
                lambda: index.match(fleet[0].url, hashes(PROMPT_A)).blocks == 0,
                "a replica gone from the fleet is forgotten",
            )

    async def main() -> None:
        context = zmq.asyncio.Context()
        sources = [ReplicaEvents(context), ReplicaEvents(context)]
        try:
            async with harness.replicas(harness.FakeReplica("r0"), harness.FakeReplica("r1")) as fleet:
                await through_the_gateway(fleet, sources)
        finally:
            for source in sources:
                source.close()
            context.term()

    asyncio.run(main())


def test_the_command_line_names_where_replicas_publish() -> None:
    endpoints = _event_endpoints(
        (
            "http://127.0.0.1:8001/=tcp://127.0.0.1:6001,tcp://127.0.0.1:6002",
            "http://127.0.0.1:8002=tcp://h:7",
        ),
        ("http://127.0.0.1:8002", "http://10.1.2.3:8000/"),
    )
    # Keyed as the replicas' URLs are given to --model (without a trailing slash).
    assert endpoints == {
        "http://127.0.0.1:8001": EventEndpoints("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002"),
        "http://127.0.0.1:8002": EventEndpoints("tcp://h:7", None, own_hashes=True),
        "http://10.1.2.3:8000": EventEndpoints("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", own_hashes=True),
    }
    for wrong in (
        "http://a:8000",
        "http://a:8000=h:7",
        "a:8000=tcp://h:7",
        "http://a=tcp://h:1,tcp://h:2,tcp://h:3",
    ):
        result = CliRunner().invoke(gateway_command, ["--model", "m=http://a:8000", "--kv-events", wrong])
        assert result.exit_code == 2 and "--kv-events" in result.output, wrong
