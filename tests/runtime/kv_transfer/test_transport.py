"""The block transport over real loopback sockets, between KV caches in the model runner's layout (one tensor
per layer, shaped (2, num_blocks, block_size, num_kv_heads, head_dim)) filled with random values: the bytes
that land are compared with the source blocks, and every block a load must not write with its old contents.

Where a misbehaving peer is needed, the test speaks the wire protocol itself from a raw socket, written out
here from the protocol's description (length-prefixed msgpack frames, tagged arrays) rather than with the
module's own encoder."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
from kvfleet.runtime.kv_transfer.transport import BlockLayout, BlockPuller, BlockServer
from ports import free_port

HOST = "127.0.0.1"
DIGEST = b"\x01" * 32
NUM_BLOCKS = 16
LOAD_TIMEOUT_S = 10.0
# The load timeout of the tests whose peer goes silent: short, so that they wait little.
SHORT_LOAD_TIMEOUT_S = 0.5


def kv_caches(
    num_layers: int = 3,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 8,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, 2, head_dim)
    return [torch.randn(shape).to(dtype) for _ in range(num_layers)]


def clone(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [cache.clone() for cache in caches]


def assert_copied(
    source: list[torch.Tensor],
    before: list[torch.Tensor],
    after: list[torch.Tensor],
    copies: dict[int, int],
) -> None:
    """Local block copies[remote] holds remote block `remote`, byte for byte; every other local block is as
    it was."""
    for layer, (remote, old, new) in enumerate(zip(source, before, after, strict=True)):
        for remote_id, local_id in copies.items():
            assert torch.equal(new[:, local_id].view(torch.uint8), remote[:, remote_id].view(torch.uint8)), (
                f"layer {layer}: local block {local_id} is not remote block {remote_id}"
            )
        for local_id in set(range(old.shape[1])) - set(copies.values()):
            assert torch.equal(new[:, local_id], old[:, local_id]), f"layer {layer}: block {local_id} touched"


def wait_for_loads(
    puller: BlockPuller, count: int, timeout: float = 10.0
) -> tuple[list[str], dict[str, str]]:
    """Collects take_done() until `count` loads ended; each request must be reported once."""
    loaded: list[str] = []
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(loaded) + len(failed) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{len(loaded) + len(failed)} of {count} loads ended within {timeout} s"
        puller.wait(remaining)
        more_loaded, more_failed = puller.take_done()
        assert not set(more_loaded) & (set(loaded) | set(failed)), "a load was reported twice"
        assert not set(more_failed) & (set(loaded) | set(failed)), "a load was reported twice"
        loaded += more_loaded
        failed |= more_failed
    return loaded, failed


def wait_for_pulled(server: BlockServer, count: int, timeout: float = 5.0) -> list[str]:
    pulled: list[str] = []
    deadline = time.monotonic() + timeout
    while len(pulled) < count and time.monotonic() < deadline:
        pulled += server.take_pulled()
        time.sleep(0.005)
    return pulled


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every test ends with the threads it began with: what the transport started, its close() stopped."""
    before = set(threading.enumerate())
    yield
    left = set(threading.enumerate()) - before
    assert not left, f"threads left running: {sorted(thread.name for thread in left)}"


@pytest.fixture
def source() -> list[torch.Tensor]:
    return kv_caches()


@pytest.fixture
def server(source: list[torch.Tensor]) -> Iterator[BlockServer]:
    server = BlockServer(source, HOST, 0)
    yield server
    server.close()


@pytest.fixture
def make_puller() -> Iterator[Callable[..., BlockPuller]]:
    pullers: list[BlockPuller] = []

    def make(caches: list[torch.Tensor], load_timeout_s: float = LOAD_TIMEOUT_S) -> BlockPuller:
        puller = BlockPuller(caches, connect_timeout_s=2.0, load_timeout_s=load_timeout_s)
        pullers.append(puller)
        return puller

    yield make
    for puller in pullers:
        puller.close()


# The wire protocol, spelt out independently of the module.


def send_frame(sock: socket.socket, message: list[Any]) -> None:
    payload = msgspec.msgpack.encode(message)
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket) -> Any:
    (size,) = struct.unpack(">I", recv_exactly(sock, 4))
    return msgspec.msgpack.decode(recv_exactly(sock, size))


def pull_request(transfer_id: str, block_ids: list[int], layout: BlockLayout, digest: bytes = DIGEST) -> list:
    wire_layout = {
        "num_layers": layout.num_layers,
        "block_shape": list(layout.block_shape),
        "dtype": layout.dtype,
    }
    return ["pull", transfer_id, digest, block_ids, wire_layout]


def block_bytes(caches: list[torch.Tensor]) -> int:
    """One block over all layers, computed from the tensors rather than the layout."""
    return sum(cache[:, 0].numel() * cache.element_size() for cache in caches)


class FakeServer:
    """A listening socket whose first connection gets `behave(connection, stop)` in a thread; close() sets
    `stop` and joins the thread."""

    def __init__(self, behave: Callable[[socket.socket, threading.Event], None]) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(10.0)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(behave,))
        self.thread.start()

    def _run(self, behave: Callable[[socket.socket, threading.Event], None]) -> None:
        with contextlib.suppress(OSError, EOFError):  # EOFError: the puller left before it asked
            connection, _ = self.listener.accept()
            with connection:
                behave(connection, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def make(behave: Callable[[socket.socket, threading.Event], None]) -> FakeServer:
        servers.append(FakeServer(behave))
        return servers[-1]

    yield make
    for fake in servers:
        fake.close()


# Pulls that succeed.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_land_byte_equal_in_their_local_blocks_and_nowhere_else(
    dtype: torch.dtype, make_puller: Callable[..., BlockPuller]
) -> None:
    source = kv_caches(dtype=dtype)
    local = kv_caches(dtype=dtype)
    before = clone(local)
    server = BlockServer(source, HOST, 0)
    try:
        puller = make_puller(local)
        server.offer("transfer", [3, 7, 1], DIGEST)
        assert (server.offers_held, server.blocks_held) == (1, 3)
        puller.start("request", HOST, server.port, "transfer", DIGEST, [3, 7, 1], [10, 0, 5])
        assert wait_for_loads(puller, 1) == (["request"], {})
        assert_copied(source, before, local, {3: 10, 7: 0, 1: 5})
        assert (puller.blocks_pulled, puller.bytes_pulled) == (3, 3 * block_bytes(source))
        assert puller.pull_seconds > 0 and puller.loads_failed == 0
        assert wait_for_pulled(server, 1) == ["transfer"]
        assert (server.offers_held, server.blocks_held, server.blocks_served) == (0, 0, 3)
        assert server.take_pulled() == [] and puller.take_done() == ([], {})
    finally:
        server.close()


def test_a_subset_of_the_offer_is_pulled_and_the_offer_is_then_forgotten(
    source: list[torch.Tensor], server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    local = kv_caches()
    before = clone(local)
    puller = make_puller(local)
    server.offer("transfer", [2, 4, 6, 8, 9], DIGEST)
    puller.start("request", HOST, server.port, "transfer", DIGEST, [8, 9], [3, 1])
    assert wait_for_loads(puller, 1) == (["request"], {})
    assert_copied(source, before, local, {8: 3, 9: 1})
    # Counted once the server has seen the pull end: the puller may hold a block before its sender counts it.
    assert wait_for_pulled(server, 1) == ["transfer"]
    assert server.blocks_served == 2

    puller.start("again", HOST, server.port, "transfer", DIGEST, [2], [4])
    _, failed = wait_for_loads(puller, 1)
    assert "unknown" in failed["again"]
    assert_copied(source, before, local, {8: 3, 9: 1})


def test_an_empty_pull_completes_the_transfer(
    server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    """A decode side that already holds the whole prefix pulls nothing, and the prefill side learns it."""
    local = kv_caches()
    before = clone(local)
    puller = make_puller(local)
    server.offer("transfer", [5], DIGEST)
    puller.start("request", HOST, server.port, "transfer", DIGEST, [], [])
    assert wait_for_loads(puller, 1) == (["request"], {})
    assert wait_for_pulled(server, 1) == ["transfer"]
    assert all(torch.equal(new, old) for new, old in zip(local, before, strict=True))


def test_many_concurrent_loads_against_one_server(
    source: list[torch.Tensor], server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    local = kv_caches()
    before = clone(local)
    puller = make_puller(local)
    # Load i copies remote block i into local block 15 - i.
    for i in range(NUM_BLOCKS):
        server.offer(f"transfer-{i}", [i], DIGEST)
    for i in range(NUM_BLOCKS):
        puller.start(f"request-{i}", HOST, server.port, f"transfer-{i}", DIGEST, [i], [NUM_BLOCKS - 1 - i])
    loaded, failed = wait_for_loads(puller, NUM_BLOCKS)
    assert failed == {}
    assert sorted(loaded) == sorted(f"request-{i}" for i in range(NUM_BLOCKS))
    assert_copied(source, before, local, {i: NUM_BLOCKS - 1 - i for i in range(NUM_BLOCKS)})
    assert sorted(wait_for_pulled(server, NUM_BLOCKS)) == sorted(f"transfer-{i}" for i in range(NUM_BLOCKS))
    assert (server.offers_held, puller.blocks_pulled) == (0, NUM_BLOCKS)


# Pulls the server refuses: the reason reaches the puller, and no local block is written.


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown transfer", "unknown"),
        ("wrong digest", "digest"),
        ("block not offered", "not in the offer"),
        ("other dtype", "layouts differ"),
        ("other block shape", "layouts differ"),
    ],
)
def test_a_refused_pull_fails_with_its_reason_and_writes_nothing(
    case: str, expected: str, server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    local = {
        "other dtype": kv_caches(dtype=torch.float16),
        "other block shape": kv_caches(head_dim=4),
    }.get(case) or kv_caches()
    before = clone(local)
    puller = make_puller(local)
    server.offer("transfer", [1, 2], DIGEST)
    transfer_id = "another" if case == "unknown transfer" else "transfer"
    digest = b"\x02" * 32 if case == "wrong digest" else DIGEST
    remote_ids = [2, 3] if case == "block not offered" else [1, 2]
    puller.start("request", HOST, server.port, transfer_id, digest, remote_ids, [0, 1])
    loaded, failed = wait_for_loads(puller, 1)
    assert loaded == [] and expected in failed["request"]
    assert puller.loads_failed == 1 and puller.blocks_pulled == 0
    assert all(torch.equal(new, old) for new, old in zip(local, before, strict=True))
    assert server.blocks_served == 0 and server.offers_held == 1  # the offer still waits for its puller


def test_an_offer_has_one_puller_at_a_time_and_is_free_again_when_that_one_leaves(
    source: list[torch.Tensor], server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    server.offer("transfer", [4], DIGEST)
    puller = make_puller(kv_caches())
    with socket.create_connection((HOST, server.port)) as first:
        send_frame(first, pull_request("transfer", [4], server.layout))
        assert recv_frame(first) == ["accepted"]
        puller.start("second", HOST, server.port, "transfer", DIGEST, [4], [0])
        _, failed = wait_for_loads(puller, 1)
        assert "another connection" in failed["second"]
    local = kv_caches()
    before = clone(local)
    retry = make_puller(local)
    deadline = time.monotonic() + 5.0
    while True:  # the server notices the first connection's end in its own time
        retry.start("retry", HOST, server.port, "transfer", DIGEST, [4], [9])
        loaded, failed = wait_for_loads(retry, 1)
        if loaded or time.monotonic() > deadline:
            break
    assert loaded == ["retry"], failed
    assert_copied(source, before, local, {4: 9})


# Withdrawn offers, silent and vanishing peers, cancelled loads.


class PausingRelay:
    """Stands between one puller and the block server, forwarding both ways, but holds the server's bytes
    after the first `pause_after` of them until `resume` is set."""

    def __init__(self, server_port: int, pause_after: int) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(10.0)
        self.port = self.listener.getsockname()[1]
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server_port, pause_after))
        self.thread.start()

    def _run(self, server_port: int, pause_after: int) -> None:
        puller, _ = self.listener.accept()
        upstream = socket.create_connection((HOST, server_port))
        with puller, upstream:
            to_server = threading.Thread(target=self._pump, args=(puller, upstream, None))
            to_server.start()
            self._pump(upstream, puller, pause_after)
            to_server.join()

    def _pump(self, source: socket.socket, target: socket.socket, pause_after: int | None) -> None:
        forwarded = 0
        with contextlib.suppress(OSError):
            while chunk := source.recv(
                2**16 if pause_after is None else max(1, min(2**16, pause_after - forwarded))
            ):
                target.sendall(chunk)
                forwarded += len(chunk)
                if forwarded == pause_after:
                    self.paused.set()
                    self.resume.wait()
                    pause_after = None
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.resume.set()
        self.thread.join()
        self.listener.close()


def test_withdraw_during_a_pull_fails_the_load_and_the_transfer_is_never_reported_pulled(
    make_puller: Callable[..., BlockPuller],
) -> None:
    # Blocks of 512 KiB: the server cannot have sent, nor the sockets buffered, every block when the relay
    # has forwarded only the first.
    source = kv_caches(num_layers=2, num_blocks=64, block_size=64, head_dim=256)
    local = [torch.zeros_like(cache) for cache in source]
    server = BlockServer(source, HOST, 0)
    accepted_frame = 4 + len(msgspec.msgpack.encode(["accepted"]))
    relay = PausingRelay(server.port, accepted_frame + block_bytes(source))
    try:
        puller = make_puller(local)
        server.offer("transfer", list(range(64)), DIGEST)
        puller.start("request", HOST, relay.port, "transfer", DIGEST, list(range(64)), list(range(64)))
        assert relay.paused.wait(10.0)
        server.withdraw("transfer")
        relay.resume.set()
        _, failed = wait_for_loads(puller, 1)
        assert "broke off" in failed["request"]
        assert all(torch.equal(new[:, 0], old[:, 0]) for new, old in zip(local, source, strict=True))
        assert all(not new[:, 63].any() for new in local)
        assert server.blocks_served < 64 and server.take_pulled() == []
    finally:
        relay.close()
        server.close()


def test_withdraw_cuts_off_a_pull_in_progress_and_the_transfer_is_never_reported_pulled() -> None:
    # Blocks of 512 KiB and a small receive buffer: the server cannot have sent every block when the
    # puller has read only the first.
    source = kv_caches(num_layers=2, num_blocks=64, block_size=64, head_dim=256)
    total = 64 * block_bytes(source)
    server = BlockServer(source, HOST, 0)
    try:
        server.offer("transfer", list(range(64)), DIGEST)
        with socket.socket() as puller:
            puller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            puller.settimeout(10.0)
            puller.connect((HOST, server.port))
            send_frame(puller, pull_request("transfer", list(range(64)), server.layout))
            assert recv_frame(puller) == ["accepted"]
            first = recv_exactly(puller, block_bytes(source))
            assert first == b"".join(
                bytes(cache[:, 0].contiguous().view(torch.uint8).numpy()) for cache in source
            )
            server.withdraw("transfer")
            received = len(first)
            while chunk := puller.recv(2**20):
                received += len(chunk)
            assert received < total
            with contextlib.suppress(OSError):
                send_frame(puller, ["done"])
        assert server.offers_held == 0 and server.blocks_served < 64
        time.sleep(0.1)
        assert server.take_pulled() == []
    finally:
        server.close()


def test_a_pull_of_a_withdrawn_offer_is_refused(
    server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    local = kv_caches()
    before = clone(local)
    puller = make_puller(local)
    server.offer("transfer", [1], DIGEST)
    server.withdraw("transfer")
    puller.start("request", HOST, server.port, "transfer", DIGEST, [1], [1])
    _, failed = wait_for_loads(puller, 1)
    assert "withdrawn" in failed["request"]
    assert all(torch.equal(new, old) for new, old in zip(local, before, strict=True))


def test_a_refused_connection_fails_at_once(make_puller: Callable[..., BlockPuller]) -> None:
    puller = make_puller(kv_caches())
    started = time.monotonic()
    puller.start("request", HOST, free_port(), "transfer", DIGEST, [1], [1])
    _, failed = wait_for_loads(puller, 1)
    assert time.monotonic() - started < 1.0
    assert "cannot connect" in failed["request"]
    assert puller.loads_failed == 1


def read_request_then_stay_silent(connection: socket.socket, stop: threading.Event) -> None:
    recv_frame(connection)
    stop.wait()


def test_a_server_that_never_answers_fails_the_load_within_its_timeout(
    make_puller: Callable[..., BlockPuller], fake_server: Callable[..., FakeServer]
) -> None:
    local = kv_caches()
    before = clone(local)
    puller = make_puller(local, load_timeout_s=SHORT_LOAD_TIMEOUT_S)
    fake = fake_server(read_request_then_stay_silent)
    started = time.monotonic()
    puller.start("request", HOST, fake.port, "transfer", DIGEST, [1], [1])
    _, failed = wait_for_loads(puller, 1)
    assert SHORT_LOAD_TIMEOUT_S <= time.monotonic() - started < SHORT_LOAD_TIMEOUT_S + 1.0
    assert "did not end within" in failed["request"]
    assert all(torch.equal(new, old) for new, old in zip(local, before, strict=True))


def test_a_server_that_goes_silent_mid_transfer_fails_the_load_and_keeps_what_was_whole(
    source: list[torch.Tensor],
    make_puller: Callable[..., BlockPuller],
    fake_server: Callable[..., FakeServer],
) -> None:
    """One whole block, then half of the next, then silence: the whole block landed, the half did not."""
    block = b"".join(bytes(cache[:, 5].contiguous().view(torch.uint8).numpy()) for cache in source)

    def one_and_a_half_blocks(connection: socket.socket, stop: threading.Event) -> None:
        recv_frame(connection)
        send_frame(connection, ["accepted"])
        connection.sendall(block + block[: len(block) // 2])
        stop.wait()

    local = kv_caches()
    before = clone(local)
    puller = make_puller(local, load_timeout_s=SHORT_LOAD_TIMEOUT_S)
    fake = fake_server(one_and_a_half_blocks)
    started = time.monotonic()
    puller.start("request", HOST, fake.port, "transfer", DIGEST, [5, 6, 7], [2, 3, 4])
    _, failed = wait_for_loads(puller, 1)
    assert time.monotonic() - started < SHORT_LOAD_TIMEOUT_S + 1.0
    assert "did not end within" in failed["request"]
    assert_copied(source, before, local, {5: 2})


def test_a_server_that_closes_mid_transfer_fails_the_load(
    source: list[torch.Tensor],
    make_puller: Callable[..., BlockPuller],
    fake_server: Callable[..., FakeServer],
) -> None:
    block = b"".join(bytes(cache[:, 5].contiguous().view(torch.uint8).numpy()) for cache in source)

    def one_block_then_close(connection: socket.socket, stop: threading.Event) -> None:
        recv_frame(connection)
        send_frame(connection, ["accepted"])
        connection.sendall(block)

    local = kv_caches()
    before = clone(local)
    puller = make_puller(local)
    fake = fake_server(one_block_then_close)
    puller.start("request", HOST, fake.port, "transfer", DIGEST, [5, 6], [2, 3])
    _, failed = wait_for_loads(puller, 1, timeout=5.0)
    assert "broke off after 1 of 2 blocks" in failed["request"]
    assert_copied(source, before, local, {5: 2})


def test_cancel_stops_a_load_and_reports_it_once(
    make_puller: Callable[..., BlockPuller], fake_server: Callable[..., FakeServer]
) -> None:
    puller = make_puller(kv_caches())
    fake = fake_server(read_request_then_stay_silent)
    puller.start("request", HOST, fake.port, "transfer", DIGEST, [1], [1])
    time.sleep(0.1)
    started = time.monotonic()
    puller.cancel("request")
    assert wait_for_loads(puller, 1) == ([], {"request": "cancelled"})
    assert time.monotonic() - started < 1.0
    assert puller.loads_failed == 0
    puller.cancel("request")
    assert puller.take_done() == ([], {})


def test_cancel_after_a_load_ended_but_before_it_was_reported_reports_it_cancelled(
    server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    puller = make_puller(kv_caches())
    server.offer("transfer", [1], DIGEST)
    puller.start("request", HOST, server.port, "transfer", DIGEST, [1], [1])
    puller.wait(5.0)
    puller.cancel("request")
    assert puller.take_done() == ([], {"request": "cancelled"})


def test_wait_returns_after_its_timeout_when_no_load_ends(make_puller: Callable[..., BlockPuller]) -> None:
    puller = make_puller(kv_caches())
    started = time.monotonic()
    puller.wait(0.2)
    assert 0.2 <= time.monotonic() - started < 1.0


def test_close_stops_every_thread_and_socket(
    source: list[torch.Tensor], fake_server: Callable[..., FakeServer]
) -> None:
    """Loads blocked on a silent server, a connection to the block server that never sends its request,
    and one that pulled part of an offer: close() ends them all (the autouse fixture counts the threads)."""
    before = set(threading.enumerate())
    server = BlockServer(source, HOST, 0)
    puller = BlockPuller(kv_caches(), connect_timeout_s=2.0, load_timeout_s=LOAD_TIMEOUT_S)
    fake = fake_server(read_request_then_stay_silent)
    server.offer("transfer", list(range(NUM_BLOCKS)), DIGEST)
    with (
        socket.create_connection((HOST, server.port)) as idle,
        socket.create_connection((HOST, server.port)) as half,
    ):
        send_frame(half, pull_request("transfer", list(range(NUM_BLOCKS)), server.layout))
        assert recv_frame(half) == ["accepted"]
        puller.start("request", HOST, fake.port, "transfer", DIGEST, [1], [1])
        deadline = time.monotonic() + 5.0
        while len(set(threading.enumerate()) - before) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(set(threading.enumerate()) - before) >= 4  # accept loop, 2 connections, 1 load
        started = time.monotonic()
        puller.close()
        server.close()
        assert time.monotonic() - started < 2.0
        assert idle.recv(1) == b""
        assert set(threading.enumerate()) - before <= {fake.thread}
        with pytest.raises(OSError):
            socket.create_connection((HOST, server.port), timeout=1.0)


def test_a_load_that_cannot_write_its_blocks_is_reported_failed(
    server: BlockServer, make_puller: Callable[..., BlockPuller]
) -> None:
    """A cache whose token slots alias one another refuses writes: the load ends failed, not silently."""
    aliased = [cache[:, :, :1].expand(-1, -1, 4, -1, -1) for cache in kv_caches()]
    puller = make_puller(aliased)
    server.offer("transfer", [1], DIGEST)
    puller.start("request", HOST, server.port, "transfer", DIGEST, [1], [1])
    _, failed = wait_for_loads(puller, 1)
    assert "the load failed" in failed["request"]


def test_start_refuses_block_lists_that_do_not_pair_or_fit(make_puller: Callable[..., BlockPuller]) -> None:
    puller = make_puller(kv_caches())
    with pytest.raises(ValueError, match="remote blocks"):
        puller.start("request", HOST, 1, "transfer", DIGEST, [1, 2], [1])
    with pytest.raises(ValueError, match="outside the cache"):
        puller.start("request", HOST, 1, "transfer", DIGEST, [1], [NUM_BLOCKS])
    assert puller.take_done() == ([], {})
