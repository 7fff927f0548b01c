"""The block transport of disaggregated prefill and decode: a decode engine pulls, over TCP, the KV blocks
that a prefill engine offers, block by block, straight into its own paged cache.

The prefill side (BlockServer) offers a finished request's blocks under an unguessable transfer id, with the
request's KV digest. The decode side (BlockPuller) connects, names the transfer, the digest, the blocks it
wants (any part of the offer) and its block layout, and gets either a refusal with its reason or the bytes of
every block asked for, in order, which it copies into its own blocks as they arrive. One exchange per
connection:

    puller -> server   _PullRequest             a length-prefixed msgpack frame
    server -> puller   _Accepted | _Refused     a frame
    server -> puller   the blocks               per block, each layer's K and V bytes, layer after layer
    puller -> server   _Done                    a frame: the offer was pulled to the end

Both sides run on threads, not asyncio: the engine core that calls them is synchronous.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import torch

logger = logging.getLogger(__name__)

_FRAME_HEADER = struct.Struct(">I")
# The largest control frame read: a pull request naming a million blocks still fits.
_MAX_FRAME_BYTES = 16 * 2**20
# How long a puller has to send its request once connected, so that a connection cannot hold a thread by
# trickling bytes; and how long the server then waits on a puller that neither reads nor writes.
_REQUEST_TIMEOUT_S = 10.0
_SERVE_IDLE_TIMEOUT_S = 60.0
# Connections served at once; more are closed unanswered, which their pullers report as failed loads.
_MAX_CONNECTIONS = 128

_Message = TypeVar("_Message")


@dataclass(frozen=True)
class BlockLayout:
    """What two engines must share for one's KV blocks to be copied into the other's as bytes."""

    num_layers: int
    block_shape: tuple[int, ...]  # one block of one layer, K and V together
    dtype: str  # e.g. "float32", "bfloat16"

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> BlockLayout:
        """The layout of the model runner's caches: one tensor per layer, shaped (2, num_blocks, ...)."""
        if not kv_caches:
            raise ValueError("there is no KV cache to describe")
        first = kv_caches[0]
        block_shape = (first.shape[0], *first.shape[2:])
        for cache in kv_caches[1:]:
            if (cache.shape[0], *cache.shape[2:]) != block_shape or cache.dtype != first.dtype:
                raise ValueError("the layers' KV caches differ in block shape or dtype")
        return cls(len(kv_caches), tuple(block_shape), str(first.dtype).removeprefix("torch."))

    @property
    def block_bytes(self) -> int:
        """The bytes of one block over all layers, as they cross the wire."""
        return self.num_layers * math.prod(self.block_shape) * getattr(torch, self.dtype).itemsize

    def staging_buffer(self, pinned: bool) -> torch.Tensor:
        """Host memory for one block over all layers."""
        shape = (self.num_layers, *self.block_shape)
        return torch.empty(shape, dtype=getattr(torch, self.dtype), pin_memory=pinned)


class _PullRequest(msgspec.Struct, tag="pull", array_like=True, frozen=True):
    transfer_id: str
    kv_digest: bytes
    block_ids: list[int]
    layout: BlockLayout


class _Accepted(msgspec.Struct, tag="accepted", array_like=True):
    pass


class _Refused(msgspec.Struct, tag="refused", array_like=True):
    reason: str


class _Done(msgspec.Struct, tag="done", array_like=True):
    pass


_ENCODER = msgspec.msgpack.Encoder()
_PULL_DECODER = msgspec.msgpack.Decoder(_PullRequest)
_ANSWER_DECODER = msgspec.msgpack.Decoder(_Accepted | _Refused)
_DONE_DECODER = msgspec.msgpack.Decoder(_Done)


class _WireError(Exception):
    """The peer broke the exchange: it closed the connection or sent what the protocol does not allow."""


def _set_deadline(sock: socket.socket, deadline: float | None) -> None:
    if deadline is not None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(remaining)


def _recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills the view from the socket; each read waits until the deadline, or the socket's own timeout."""
    while view:
        _set_deadline(sock, deadline)
        received = sock.recv_into(view)
        if received == 0:
            raise _WireError("the peer closed the connection")
        view = view[received:]


def _send_frame(sock: socket.socket, message: msgspec.Struct, deadline: float | None = None) -> None:
    payload = _ENCODER.encode(message)
    _set_deadline(sock, deadline)
    sock.sendall(_FRAME_HEADER.pack(len(payload)) + payload)


def _recv_frame(
    sock: socket.socket, decoder: msgspec.msgpack.Decoder[_Message], deadline: float | None = None
) -> _Message:
    header = bytearray(_FRAME_HEADER.size)
    _recv_exactly(sock, memoryview(header), deadline)
    (size,) = _FRAME_HEADER.unpack(header)
    if size > _MAX_FRAME_BYTES:
        raise _WireError(f"a control frame of {size} bytes")
    payload = bytearray(size)
    _recv_exactly(sock, memoryview(payload), deadline)
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as error:
        raise _WireError(f"an unexpected frame: {error}") from error


def _cut(sock: socket.socket) -> None:
    """Ends a connection that another thread may be blocked on: its reads return and its writes fail."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _bytes_of(staging: torch.Tensor) -> memoryview:
    return memoryview(staging.view(-1).view(torch.uint8).numpy())


@dataclass(eq=False)
class _Offer:
    block_ids: frozenset[int]
    kv_digest: bytes
    # Held while a block is read and when the offer is withdrawn: once withdraw() returns, no block of the
    # offer is read again, so the engine may reuse them.
    lock: threading.Lock = field(default_factory=threading.Lock)
    withdrawn: bool = False
    # The connection pulling the offer, once one is accepted; an offer has one puller at a time.
    puller: socket.socket | None = None


class BlockServer:
    """The prefill side: serves the blocks it offers to pullers, one thread per connection."""

    def __init__(self, kv_caches: list[torch.Tensor], host: str, port: int) -> None:
        self.layout = BlockLayout.of(kv_caches)
        self._kv_caches = kv_caches
        self._num_blocks = kv_caches[0].shape[1]
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}
        self._pulled: list[str] = []
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        # Counters for metrics.
        self.blocks_served = 0
        self.offers_held = 0
        self.blocks_held = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-block-server-{self.port}", daemon=True
        )
        self._accept_thread.start()

    def offer(self, transfer_id: str, block_ids: list[int], kv_digest: bytes) -> None:
        """Lets one puller presenting the same digest pull these blocks (or part of them) under the id."""
        outside = [block_id for block_id in block_ids if not 0 <= block_id < self._num_blocks]
        if outside:
            raise ValueError(f"block ids outside the cache of {self._num_blocks} blocks: {outside[:8]}")
        with self._lock:
            if transfer_id in self._offers:
                raise ValueError("the transfer id is already offered")
            self._offers[transfer_id] = _Offer(frozenset(block_ids), kv_digest)
            self._count_offers()

    def withdraw(self, transfer_id: str) -> None:
        """Forgets an offer (expired or aborted): a pull in progress is cut off, no block of the offer is read
        once this returns, and take_pulled() will not name it."""
        with self._lock:
            offer = self._offers.pop(transfer_id, None)
            with contextlib.suppress(ValueError):
                self._pulled.remove(transfer_id)
            self._count_offers()
            puller = offer.puller if offer is not None else None
        if offer is None:
            return
        with offer.lock:
            offer.withdrawn = True
        if puller is not None:
            _cut(puller)

    def take_pulled(self) -> list[str]:
        """The transfers pulled to the end since the last call, which the server has forgotten."""
        with self._lock:
            pulled, self._pulled = self._pulled, []
        return pulled

    def close(self) -> None:
        """Stops serving: every offer is withdrawn, every connection cut, every thread joined."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            offers = list(self._offers.values())
            self._offers.clear()
            self._pulled.clear()
            self._count_offers()
            connections = dict(self._connections)
        for offer in offers:
            with offer.lock:
                offer.withdrawn = True
        self._wake_writer.send(b"\0")
        self._accept_thread.join()
        for connection in connections:
            _cut(connection)
        for thread in connections.values():
            thread.join()
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            sock.close()

    def _count_offers(self) -> None:
        self.offers_held = len(self._offers)
        self.blocks_held = sum(len(offer.block_ids) for offer in self._offers.values())

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fileobj is self._wake_reader for key, _ in ready):
                    return
                try:
                    connection, _ = self._listener.accept()
                except OSError:  # the peer gave up before it was accepted
                    continue
                self._serve_in_thread(connection)

    def _serve_in_thread(self, connection: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._connections) < _MAX_CONNECTIONS:
                thread = threading.Thread(
                    target=self._serve, args=(connection,), name=f"kv-block-serve-{self.port}", daemon=True
                )
                self._connections[connection] = thread
                thread.start()
                return
        logger.warning("KV block server on port %d: too many connections, one refused", self.port)
        connection.close()

    def _serve(self, connection: socket.socket) -> None:
        offer = None
        try:
            request = _recv_frame(connection, _PULL_DECODER, time.monotonic() + _REQUEST_TIMEOUT_S)
            connection.settimeout(_SERVE_IDLE_TIMEOUT_S)
            offer, refusal = self._claim(request, connection)
            if offer is None:
                _send_frame(connection, _Refused(refusal))
                return
            _send_frame(connection, _Accepted())
            self._send_blocks(connection, offer, request.block_ids)
            _recv_frame(connection, _DONE_DECODER)
            self._finish(request.transfer_id, offer)
        except (OSError, _WireError) as error:
            logger.debug("KV block server on port %d: a pull ended early: %s", self.port, error)
        finally:
            connection.close()
            with self._lock:
                if offer is not None and offer.puller is connection:
                    offer.puller = None  # pulled to the end, or the puller left midway and may come back
                del self._connections[connection]

    def _claim(self, request: _PullRequest, connection: socket.socket) -> tuple[_Offer | None, str]:
        """The offer the request may pull, now claimed by this connection; or None and the reason why not."""
        with self._lock:
            offer = self._offers.get(request.transfer_id)
            if offer is None:
                return None, "the transfer is unknown, withdrawn or already pulled"
            if not hmac.compare_digest(offer.kv_digest, request.kv_digest):
                return None, "the KV digest differs from the offer's"
            if request.layout != self.layout:
                return (
                    None,
                    f"the block layouts differ: the server's is {self.layout}, the puller's {request.layout}",
                )
            not_offered = sorted(set(request.block_ids) - offer.block_ids)
            if not_offered:
                return None, f"{len(not_offered)} block ids are not in the offer: {not_offered[:8]}"
            if offer.puller is not None:
                return None, "the transfer is being pulled by another connection"
            offer.puller = connection
            return offer, ""

    @torch.inference_mode()
    def _send_blocks(self, connection: socket.socket, offer: _Offer, block_ids: list[int]) -> None:
        staging = self.layout.staging_buffer(pinned=self._kv_caches[0].is_cuda)
        data = _bytes_of(staging)
        for block_id in block_ids:
            with offer.lock:
                if offer.withdrawn:
                    raise _WireError("the transfer was withdrawn")
                for layer, cache in enumerate(self._kv_caches):
                    staging[layer].copy_(cache[:, block_id])
            connection.sendall(data)
            with self._lock:
                self.blocks_served += 1

    def _finish(self, transfer_id: str, offer: _Offer) -> None:
        with self._lock:
            if self._offers.get(transfer_id) is offer:
                del self._offers[transfer_id]
                self._pulled.append(transfer_id)
                self._count_offers()


class _LoadFailure(Exception):
    """Why a load failed, as the puller reports it."""


@dataclass(eq=False)
class _Load:
    request_id: str
    cancelled: bool = False
    # The connection, once made: cancel() cuts it so that a blocked read returns at once.
    sock: socket.socket | None = None
    blocks_written: int = 0


class BlockPuller:
    """The decode side: each load runs in a background thread and writes only its own local blocks."""

    def __init__(
        self, kv_caches: list[torch.Tensor], *, connect_timeout_s: float, load_timeout_s: float
    ) -> None:
        self.layout = BlockLayout.of(kv_caches)
        self._kv_caches = kv_caches
        self._num_blocks = kv_caches[0].shape[1]
        self._connect_timeout_s = connect_timeout_s
        self._load_timeout_s = load_timeout_s
        self._lock = threading.Lock()
        self._load_ended = threading.Condition(self._lock)
        self._loads: dict[str, _Load] = {}
        self._threads: list[threading.Thread] = []
        self._loaded: list[str] = []
        self._failed: dict[str, str] = {}
        self._closed = False
        # Counters for metrics: blocks, bytes and seconds of the loads that succeeded; the loads that failed
        # (cancelled ones are not failures).
        self.blocks_pulled = 0
        self.bytes_pulled = 0
        self.pull_seconds = 0.0
        self.loads_failed = 0

    def start(
        self,
        request_id: str,
        host: str,
        port: int,
        transfer_id: str,
        kv_digest: bytes,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        """Starts copying remote block remote_block_ids[i] into local block local_block_ids[i]."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks for {len(local_block_ids)} local blocks")
        outside = [block_id for block_id in local_block_ids if not 0 <= block_id < self._num_blocks]
        if outside:
            raise ValueError(f"block ids outside the cache of {self._num_blocks} blocks: {outside[:8]}")
        request = _PullRequest(transfer_id, kv_digest, list(remote_block_ids), self.layout)
        load = _Load(request_id)
        with self._lock:
            if self._closed:
                raise RuntimeError("the block puller is closed")
            if request_id in self._loads or request_id in self._loaded or request_id in self._failed:
                raise ValueError(f"request {request_id} already has a load")
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            thread = threading.Thread(
                target=self._run,
                args=(load, (host, port), request, list(local_block_ids)),
                name=f"kv-pull-{request_id}",
                daemon=True,
            )
            self._loads[request_id] = load
            self._threads.append(thread)
            thread.start()

    def cancel(self, request_id: str) -> None:
        """Stops a load; take_done() reports it failed ("cancelled") once its thread stopped writing."""
        with self._lock:
            load = self._loads.get(request_id)
            if load is None:
                if request_id in self._loaded:  # ended, not yet reported
                    self._loaded.remove(request_id)
                    self._failed[request_id] = "cancelled"
                return
            load.cancelled = True
            sock = load.sock
        if sock is not None:
            _cut(sock)

    def take_done(self) -> tuple[list[str], dict[str, str]]:
        """The loads that ended since the last call: (loaded request ids, failed request id -> reason)."""
        with self._lock:
            loaded, self._loaded = self._loaded, []
            failed, self._failed = self._failed, {}
        return loaded, failed

    def wait(self, timeout: float) -> None:
        """Returns when a load ends (at once if one ended and is not reported yet), or after timeout."""
        with self._load_ended:
            if not self._loaded and not self._failed:
                self._load_ended.wait(timeout)

    def close(self) -> None:
        """Cancels every load and joins its thread."""
        with self._lock:
            self._closed = True
            loads = list(self._loads.values())
            threads = list(self._threads)
            for load in loads:
                load.cancelled = True
        for load in loads:
            if load.sock is not None:
                _cut(load.sock)
        for thread in threads:
            thread.join()

    def _run(
        self, load: _Load, address: tuple[str, int], request: _PullRequest, local_block_ids: list[int]
    ) -> None:
        started = time.monotonic()
        reason = None
        try:
            self._pull(load, address, request, local_block_ids, started + self._load_timeout_s)
        except _LoadFailure as failure:
            reason = str(failure)
        except TimeoutError:
            reason = f"the load did not end within {self._load_timeout_s:g} s"
        except (OSError, _WireError) as error:
            written = f"{load.blocks_written} of {len(local_block_ids)} blocks"
            reason = f"the transfer broke off after {written}: {error}"
        except Exception as error:  # whatever went wrong, the request must learn that its load ended
            logger.exception("KV load of request %s: unexpected error", load.request_id)
            reason = f"the load failed: {error!r}"
        self._end(load, reason, len(local_block_ids), time.monotonic() - started)

    def _pull(
        self,
        load: _Load,
        address: tuple[str, int],
        request: _PullRequest,
        local_block_ids: list[int],
        deadline: float,
    ) -> None:
        try:
            sock = socket.create_connection(
                address, timeout=min(self._connect_timeout_s, self._load_timeout_s)
            )
        except OSError as error:
            raise _LoadFailure(f"cannot connect to {address[0]}:{address[1]}: {error}") from error
        with sock:
            with self._lock:
                load.sock = sock
                if load.cancelled:
                    return
            _send_frame(sock, request, deadline)
            answer = _recv_frame(sock, _ANSWER_DECODER, deadline)
            if isinstance(answer, _Refused):
                raise _LoadFailure(f"the block server refused the pull: {answer.reason}")
            self._receive_blocks(load, sock, local_block_ids, deadline)
            if not load.cancelled:
                _send_frame(sock, _Done(), deadline)

    @torch.inference_mode()
    def _receive_blocks(
        self, load: _Load, sock: socket.socket, local_block_ids: list[int], deadline: float
    ) -> None:
        staging = self.layout.staging_buffer(pinned=self._kv_caches[0].is_cuda)
        data = _bytes_of(staging)
        for block_id in local_block_ids:
            _recv_exactly(sock, data, deadline)
            if load.cancelled:
                return
            for layer, cache in enumerate(self._kv_caches):
                cache[:, block_id].copy_(staging[layer])
            load.blocks_written += 1

    def _end(self, load: _Load, reason: str | None, num_blocks: int, seconds: float) -> None:
        with self._lock:
            del self._loads[load.request_id]
            if load.cancelled:
                reason = "cancelled"
            elif reason is None:
                self.blocks_pulled += num_blocks
                self.bytes_pulled += num_blocks * self.layout.block_bytes
                self.pull_seconds += seconds
            else:
                self.loads_failed += 1
            if reason is None:
                self._loaded.append(load.request_id)
            else:
                self._failed[load.request_id] = reason
            self._load_ended.notify_all()
        if reason is not None and not load.cancelled:
            logger.warning("KV load of request %s failed: %s", load.request_id, reason)
