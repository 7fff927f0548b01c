"""The gateway's subscribers to its replicas' KV events (kvfleet.contract.kv_events), which keep the
`precise-prefix` policy's block index (kvfleet.gateway.kv_index) in step with the replicas' caches.

One subscriber per replica, on the gateway's event loop (pyzmq's asyncio sockets): the index is then read
by routing and written by the subscribers on one thread, without locks, and a message is decoded and applied
whole between two routing decisions. Its cost is bounded by the message cap and the cap on blocks per batch.

A subscriber connects its SUB socket, then asks the replica's replay socket for every batch from 0, which
teaches it the cache of a replica that was running before the gateway. A replica's live sequence numbers
only grow, one per batch, so:

- a number past the next one expected is a gap: the missing batches are asked from the replay socket. When
  it cannot give them (its first batch is past the missing one, it does not answer in time, or the replica
  has no replay socket), what the index holds of the replica may be stale: it is dropped, and rebuilt from
  the events that follow. A replay socket that did not answer is not asked again for REPLAY_RETRY_S;
- a number below the next expected, above the last one received live, was already had from a replay and is
  skipped;
- a number at or below the last one received live means the replica restarted (its cache is empty): its
  entries are dropped.

A stream that breaks the format (not three frames, a sequence number of the wrong size, a payload that does
not decode, a batch with more blocks than MAX_BLOCKS_PER_BATCH or a block size below 1) drops the replica's
entries; the subscriber goes on with the next message. A message over MAX_MESSAGE_BYTES makes ZeroMQ drop
the connection, and it does not reconnect by itself after that: a subscriber makes every connection that
drops again, with a new socket, and what was published meanwhile is a gap. Every drop counts under its
reason, and a replica's stream only ever touches that replica's entries.

Where a replica publishes: its host at the contract's ports by default (a Kubernetes replica's pod address),
or the endpoints given for its URL (`kvfleet gateway --kv-events`, for replicas sharing a host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from kvfleet.contract.kv_events import (
    DEFAULT_EVENTS_PORT,
    DEFAULT_REPLAY_PORT,
    END_OF_REPLAY,
    decode_sequence,
    encode_sequence,
)
from kvfleet.gateway.kv_index import KVBlockIndex
from kvfleet.gateway.kv_rehash import TokenRehasher
from kvfleet.gateway.metrics import KVIndexMetrics
from kvfleet.runtime.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)

logger = logging.getLogger(__name__)

# A batch is one engine step's events. A step's prefills hold a few tens of thousand tokens, whose
# BlockStored events take a few hundred KB; a message past this is no batch a replica sends.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# 4M tokens' worth of blocks of 16, far past any step's.
MAX_BLOCKS_PER_BATCH = 256 * 1024
# Live messages a subscriber holds while it applies others or waits for a replay: ten seconds of a replica
# that publishes a batch every 10 ms step. Past it ZeroMQ drops new ones, which makes a gap. A replica's
# stream thus holds at most this many messages of at most MAX_MESSAGE_BYTES in the gateway; honest ones are
# a few KB.
RECEIVE_HIGH_WATER_MARK = 1000
# A replay sends at most the replica's buffered batches (10,000 by default) and is read as it arrives.
REPLAY_TIMEOUT_S = 10.0
# After a replay that timed out (a replica may run no replay socket at all), gaps drop the entries at once for
# this long, rather than holding the live stream for every one of them.
REPLAY_RETRY_S = 60.0
MAX_REPLAY_BATCHES = 100_000
RECONNECT_DELAY_S = 0.2


@dataclass(frozen=True)
class EventEndpoints:
    """Where a replica publishes its KV events (ZeroMQ endpoints), and answers replays (None: it does
    not). `own_hashes`: its engine hashes blocks by a rule of its own (vLLM), so its blocks are indexed by
    their tokens (kvfleet.gateway.kv_rehash)."""

    publisher: str
    replay: str | None = None
    own_hashes: bool = False


def default_endpoints(replica_url: str) -> EventEndpoints:
    """The replica's host at the contract's ports."""
    host = urlsplit(replica_url).hostname or ""
    host = f"[{host}]" if ":" in host else host
    return EventEndpoints(f"tcp://{host}:{DEFAULT_EVENTS_PORT}", f"tcp://{host}:{DEFAULT_REPLAY_PORT}")


class _Broken(Exception):
    """The stream broke the format; `reason` is the metric's label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _checked_batch(payload: bytes) -> KVEventBatch:
    """A batch, in either of vLLM's encodings, whose events the index may apply; _Broken otherwise."""
    try:
        batch = decode_batch(payload)
    except msgspec.DecodeError as error:
        raise _Broken("undecodable", str(error)) from None
    blocks = 0
    for event in batch.events:
        if isinstance(event, BlockStored | BlockRemoved):
            blocks += len(event.block_hashes)
        if isinstance(event, BlockStored) and event.block_size < 1:
            raise _Broken("invalid_batch", f"a block size of {event.block_size}")
    if blocks > MAX_BLOCKS_PER_BATCH or len(batch.events) > MAX_BLOCKS_PER_BATCH:
        raise _Broken("oversized_batch", f"{blocks} blocks in {len(batch.events)} events")
    return batch


class ReplicaSubscriber:
    """Follows one replica's events into the index, until cancelled; its entries go when it stops."""

    def __init__(
        self,
        replica: str,
        endpoints: EventEndpoints,
        index: KVBlockIndex,
        metrics: KVIndexMetrics,
        context: zmq.asyncio.Context,
    ) -> None:
        self.replica = replica
        self.endpoints = endpoints
        self._index = index
        self._metrics = metrics
        self._context = context
        # The sequence number the next batch should carry; None when any will do (nothing is known).
        self._next: int | None = None
        # The last sequence number received on the live socket.
        self._last_live = -1
        # Event-loop time before which no replay is asked.
        self._replay_after = 0.0
        self._rehasher = TokenRehasher(index.max_entries) if endpoints.own_hashes else None

    async def run(self) -> None:
        try:
            await self._follow(first=True)
            while True:
                # A replica that cuts every connection off is not reconnected to in a busy loop.
                await asyncio.sleep(RECONNECT_DELAY_S)
                await self._follow(first=False)
        finally:
            self._drop("replica_removed")

    async def _follow(self, *, first: bool) -> None:
        """Receives the live stream until its connection drops. ZeroMQ reconnects by itself after most
        failures, but not after it refused a message over the size cap: each connection gets a socket of its
        own. The batches missed in between are a gap."""
        subscriber = self._socket(zmq.SUB)
        subscriber.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = subscriber.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        subscriber.connect(self.endpoints.publisher)
        poller = zmq.asyncio.Poller()
        poller.register(subscriber, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            if first:
                await self._replay(0, needed=False)
            while True:
                ready = dict(await poller.poll())
                if subscriber in ready:
                    await self._receive(await subscriber.recv_multipart())
                elif monitor in ready:
                    logger.info("%s: the KV event stream was cut off; reconnecting", self.replica)
                    return
        finally:
            subscriber.disable_monitor()
            monitor.close(linger=0)
            subscriber.close(linger=0)

    async def _receive(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise _Broken("malformed", f"{len(frames)} frames")
            sequence = _sequence(frames[1])
        except _Broken as broken:
            self._broken(broken)
            self._next = None
            return
        went_back = sequence <= self._last_live
        self._last_live = sequence
        if went_back:
            logger.info(
                "%s: KV events restarted at %d; its cached blocks are forgotten", self.replica, sequence
            )
            self._drop("restarted")
            self._next = 0
        if self._next is not None and sequence < self._next:
            return  # had from a replay
        if self._next is not None and sequence > self._next:
            await self._replay(self._next, needed=True)
            if self._next is not None and sequence < self._next:
                return
        self._apply(sequence, frames[2])

    def _apply(self, sequence: int, payload: bytes) -> None:
        self._next = sequence + 1
        try:
            batch = _checked_batch(payload)
        except _Broken as broken:
            self._broken(broken)
            return
        index, replica, rehasher = self._index, self.replica, self._rehasher
        for event in batch.events:
            if isinstance(event, BlockStored):
                hashes = event.block_hashes if rehasher is None else rehasher.stored(event)
                index.store(replica, hashes, event.medium, event.block_size)
            elif isinstance(event, BlockRemoved):
                hashes = event.block_hashes if rehasher is None else rehasher.removed(event.block_hashes)
                index.remove(replica, hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                index.drop(replica)
                if rehasher is not None:
                    rehasher.clear()
            self._metrics.events.labels(type(event).__name__).inc()
        self._metrics.index_blocks.set(len(index))

    async def _replay(self, start: int, *, needed: bool) -> None:
        """Applies the batches the replay socket holds from `start` on. `needed`: the batches from `start`
        were published (a gap), and the entries are dropped unless the replay gives them all."""
        loop = asyncio.get_running_loop()
        if self.endpoints.replay is None or loop.time() < self._replay_after:
            if needed:
                self._metrics.replays.labels("unavailable").inc()
                self._drop("unreplayable_gap")
                self._next = None
            return
        requester = self._socket(zmq.DEALER)
        requester.connect(self.endpoints.replay)
        outcome = "complete"
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                await requester.send_multipart([b"", encode_sequence(start)])
                outcome = await self._replayed(requester, start, needed)
        except TimeoutError:
            # A replica that runs no replay socket never answers: only a gap makes that cost the entries.
            outcome = "timeout"
            self._replay_after = loop.time() + REPLAY_RETRY_S
            if needed:
                self._drop("replay_timeout")
                self._next = None
        except _Broken as broken:
            outcome = "broken"
            self._broken(broken)
            self._next = None
        finally:
            requester.close(linger=0)
            self._metrics.replays.labels(outcome).inc()

    async def _replayed(self, requester: zmq.asyncio.Socket, start: int, needed: bool) -> str:
        """The replay's outcome, once its batches are applied."""
        outcome, gap_open = "complete", needed
        for _ in range(MAX_REPLAY_BATCHES + 1):
            frames = await requester.recv_multipart()
            # [b"", topic, sequence, payload], or without the topic from earlier vLLM releases.
            if len(frames) not in (3, 4) or frames[0]:
                raise _Broken("malformed", f"a replay answer of {len(frames)} frames")
            frames = frames[-3:]
            if frames[1] == END_OF_REPLAY:
                if gap_open:
                    self._drop("unreplayable_gap")
                    return "unreplayable"
                return outcome
            sequence = _sequence(frames[1])
            if gap_open:
                gap_open = False
                if sequence > start:
                    # The replica no longer holds the missing batches: what they removed is still indexed.
                    self._drop("unreplayable_gap")
                    outcome = "unreplayable"
            if self._next is not None and sequence < self._next:
                continue
            self._apply(sequence, frames[2])
        raise _Broken("oversized_batch", f"a replay of more than {MAX_REPLAY_BATCHES} batches")

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IPV6, 1)
        return socket

    def _broken(self, broken: _Broken) -> None:
        logger.warning("%s: bad KV event stream (%s: %s)", self.replica, broken.reason, broken)
        self._drop(broken.reason)

    def _drop(self, reason: str) -> None:
        self._index.drop(self.replica)
        if self._rehasher is not None:
            self._rehasher.clear()
        self._metrics.drops.labels(reason).inc()
        self._metrics.index_blocks.set(len(self._index))


def _sequence(frame: bytes) -> int:
    try:
        return decode_sequence(frame)
    except ValueError as error:
        raise _Broken("malformed", str(error)) from None


class KVEventFeeds:
    """A subscriber for each replica the gateway follows, started and stopped as discovery changes them."""

    def __init__(
        self,
        index: KVBlockIndex,
        metrics: KVIndexMetrics,
        endpoints: Mapping[str, EventEndpoints] | None = None,
    ) -> None:
        """`endpoints`: where the replicas at these URLs publish, when not at their host's default ports."""
        self.index = index
        self._metrics = metrics
        self._endpoints = dict(endpoints or {})
        self._context: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def follow(self, replicas: Iterable[str]) -> None:
        """Subscribes to these replicas' events, and to no others'. Called on the event loop."""
        wanted = set(replicas)
        for replica in [replica for replica in self._tasks if replica not in wanted]:
            self._tasks.pop(replica).cancel()
        for replica in sorted(wanted - self._tasks.keys()):
            if self._context is None:
                self._context = zmq.asyncio.Context()
            endpoints = self._endpoints.get(replica) or default_endpoints(replica)
            subscriber = ReplicaSubscriber(replica, endpoints, self.index, self._metrics, self._context)
            self._tasks[replica] = asyncio.create_task(
                subscriber.run(), name=f"kvfleet-gateway-kv-events {replica}"
            )

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.term()
            self._context = None
