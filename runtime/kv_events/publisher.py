"""Publishers of KV events: the null one, when events are off, and the ZeroMQ one of vLLM's format.

The engine core hands a step's events over in one call that never waits: the batch joins a bounded queue and
a thread sends it. A batch is numbered when it is handed over, so a batch dropped from a full queue (the
oldest goes) leaves a gap in the numbers that subscribers see; the replay socket cannot fill it, which tells
them to forget what they know of this replica and rebuild from new events rather than trust a stale view.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import NamedTuple, Protocol

import zmq
from kvfleet.contract.kv_events import END_OF_REPLAY, decode_sequence, encode_sequence
from kvfleet.runtime.kv_events.config import KVEventsConfig, binds
from kvfleet.runtime.kv_events.wire import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

_WAKE_ENDPOINT = "inproc://kv-events-wake"
_MAX_REPLAY_REQUEST_BYTES = 1024
# How long shutdown waits for the thread to send what is queued.
_JOIN_TIMEOUT_S = 5.0


class EventPublisher(Protocol):
    # Cumulative: events sent on the PUB socket, batches dropped from the full queue, and batches sent again
    # on replay requests.
    events_published: int
    batches_dropped: int
    batches_replayed: int

    def publish(self, events: list[KVEvent]) -> None:
        """Hand one step's events over; never blocks."""

    def shutdown(self) -> None: ...


class NullEventPublisher:
    events_published = 0
    batches_dropped = 0
    batches_replayed = 0

    def publish(self, events: list[KVEvent]) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_event_publisher(config: KVEventsConfig | None) -> EventPublisher:
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config)


class QueuedBatch(NamedTuple):
    sequence: int
    payload: bytes
    num_events: int


class DropOldestQueue:
    """Batches waiting for the publisher thread: at most `max_size`, the oldest dropped (and counted) to make
    room."""

    def __init__(self, max_size: int) -> None:
        self._max_size = max_size
        self._items: deque[QueuedBatch] = deque()
        self._lock = threading.Lock()
        self.dropped = 0

    def put(self, batch: QueuedBatch) -> None:
        with self._lock:
            if len(self._items) >= self._max_size:
                self._items.popleft()
                self.dropped += 1
            self._items.append(batch)

    def take_all(self) -> list[QueuedBatch]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items


class ZmqEventPublisher:
    """PUB frames `[topic, sequence, payload]`; the replay socket (ROUTER) keeps the last `buffer_steps`
    batches. The thread owns both sockets; the engine's thread only queues and wakes it."""

    def __init__(self, config: KVEventsConfig) -> None:
        self._config = config
        self._topic = config.topic.encode()
        self._queue = DropOldestQueue(config.max_queue_size)
        self._next_sequence = 0
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.events_published = 0
        self.batches_replayed = 0
        self._stopping = False
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake = self._context.socket(zmq.PAIR)
        try:
            self._open_sockets()
        except zmq.ZMQError as error:
            self._close()
            endpoints = ", ".join(e for e in (config.endpoint, config.replay_endpoint) if e is not None)
            raise ValueError(f"kv_events_config: cannot open {endpoints}: {error}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @property
    def batches_dropped(self) -> int:
        return self._queue.dropped

    def _open_sockets(self) -> None:
        config = self._config
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            # Room for one whole answer per subscriber: a ROUTER drops what is past its high-water mark.
            self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
            # A request is one 8-byte number: anything much larger is refused before it is read.
            self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLAY_REQUEST_BYTES)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        # One wake-up pair per publisher: inproc names are per context.
        self._wake_in.bind(_WAKE_ENDPOINT)
        self._wake.connect(_WAKE_ENDPOINT)
        self._wake.setsockopt(zmq.LINGER, 0)

    def publish(self, events: list[KVEvent]) -> None:
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events), self._config.encoding)
        self._queue.put(QueuedBatch(self._next_sequence, payload, len(events)))
        self._next_sequence += 1
        self._wake_thread()

    def shutdown(self) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        if self._stopping:
            return
        self._stopping = True
        self._wake_thread()
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the KV events publisher did not stop within %.0f s", _JOIN_TIMEOUT_S)
            return
        self._close()

    def _wake_thread(self) -> None:
        # Again: wake-ups already wait, and the thread will look at the queue.
        with contextlib.suppress(zmq.Again):
            self._wake.send(b"", zmq.NOBLOCK)

    def _close(self) -> None:
        for socket in (self._pub, self._replay, self._wake, self._wake_in):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:
            logger.exception("the KV events publisher stopped; no more events are published")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_in in ready:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
            self._send_queued()
            if self._replay is not None and self._replay in ready:
                self._answer_replays()
            if self._stopping:
                self._send_queued()
                return

    def _send_queued(self) -> None:
        for sequence, payload, num_events in self._queue.take_all():
            self._pub.send_multipart((self._topic, encode_sequence(sequence), payload))
            self._replay_buffer.append((sequence, payload))
            self.events_published += num_events

    def _answer_replays(self) -> None:
        """Each request `[identity, b"", start]` is answered with every kept batch from `start` on, then the
        end marker. Malformed requests are ignored."""
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[1]:
                continue
            identity, _, start_frame = frames
            try:
                start = decode_sequence(start_frame)
            except ValueError:
                continue
            for sequence, payload in self._replay_buffer:
                if sequence >= start:
                    answer = (self._topic, encode_sequence(sequence), payload)
                    self._replay.send_multipart((identity, b"", *answer))
                    self.batches_replayed += 1
            self._replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))
