"""A served replica's KV events (the shared server's), through the API server: the engine core process
publishes them, a request's cache_salt reaches the block hashes it announces, bad salts are refused with a
400 naming the field, the publisher's counters reach /metrics, and a reset through the API clears every
block."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import pytest
import zmq
from kvfleet.contract.block_hash import block_hashes, chain_seed, external_block_hash
from vllm_kv_events import AllBlocksCleared, BlockStored, KVEventBatch

if TYPE_CHECKING:
    from servers import ServerProcess

# The server's default.
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def subscriber(api_server_events_port: int) -> Iterator[zmq.Socket]:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(f"tcp://127.0.0.1:{api_server_events_port}")
    yield socket
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def http(api_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.url, headers=api_server.headers(), timeout=60) as client:
        yield client


def _complete(http: httpx.Client, prompt: list[int], **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    return http.post("/v1/completions", json=body)


def _announced(
    http: httpx.Client, subscriber: zmq.Socket, prompt: list[int], salt: str, timeout: float
) -> list[int]:
    """Runs the prompt with the salt: the device blocks announced until its blocks have been (or the time is
    up)."""
    expected = _hashes(prompt, salt)
    response = _complete(http, prompt, cache_salt=salt)
    assert response.status_code == 200, response.text
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    announced: list[int] = []
    deadline = time.monotonic() + timeout
    while not set(expected) <= set(announced) and subscriber.poll(max(deadline - time.monotonic(), 0) * 1000):
        _, _, payload = subscriber.recv_multipart()
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored) and event.medium == "GPU":
                announced += event.block_hashes
    return announced


def _hashes(prompt: list[int], salt: str) -> list[int]:
    return [external_block_hash(h) for h in block_hashes(prompt, BLOCK_SIZE, chain_seed(cache_salt=salt))]


def test_a_salted_request_announces_the_blocks_of_its_salt(
    api_server: ServerProcess, http: httpx.Client, subscriber: zmq.Socket
) -> None:
    prompt = list(range(100, 100 + 3 * BLOCK_SIZE + 5))
    # The subscription reaches the engine core's publisher some time after the connection.
    probes = 0
    while not _announced(http, subscriber, prompt, f"probe-{probes}", timeout=0.5):
        probes += 1
        assert probes < 20, "no event reached the subscriber"
    for salt in ("tenant-a", "tenant-b"):
        announced = _announced(http, subscriber, prompt, salt, timeout=30)
        # In one run, in order (the shared server may announce other tests' blocks around them).
        expected = _hashes(prompt, salt)
        start = announced.index(expected[0]) if expected[0] in announced else -1
        assert announced[start : start + len(expected)] == expected
    assert not set(_hashes(prompt, "tenant-a")) & set(_hashes(prompt, "tenant-b"))
    metrics = api_server.metrics()
    # Counted once sent, which may be after the stats of the step that made them left the core.
    assert metrics["kvfleet:kv_events_published_total"] >= 2
    assert metrics["kvfleet:kv_event_batches_dropped_total"] == 0


def test_a_reset_through_the_api_clears_all_blocks(http: httpx.Client, subscriber: zmq.Socket) -> None:
    assert http.post("/reset_prefix_cache").status_code == 200
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events: list[Any] = []
    while AllBlocksCleared() not in events:
        assert subscriber.poll(30_000), "no AllBlocksCleared after the reset"
        events = decoder.decode(subscriber.recv_multipart()[2]).events
    # A reset's batch holds nothing else.
    assert events == [AllBlocksCleared()]


@pytest.mark.parametrize(
    ("path", "salt"),
    [
        ("/v1/completions", ""),
        ("/v1/completions", "x" * 1025),
        ("/v1/completions", 7),
        ("/v1/chat/completions", ""),
        ("/v1/chat/completions", ["a"]),
    ],
)
def test_a_bad_cache_salt_is_a_400(http: httpx.Client, path: str, salt: object) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 1, "cache_salt": salt}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt", response.text
