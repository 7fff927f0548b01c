"""Slow clients cannot hold the server: a request's headers and body must arrive in time, and a response whose
client stops reading is dropped, its request aborted and its KV blocks freed. Raw sockets on loopback, so that
nothing on the client side hurries the bytes along; every wait is bounded."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import pytest
from server_checks import RequestBeside, finished_count, openai_error, wait_idle

if TYPE_CHECKING:
    from servers import ServerProcess

# Seconds; short, so that the tests are.
TIMEOUT = "1"
# Between two trickled pieces, and how many a test sends at most before it gives up on the server.
TRICKLE_S = 0.2
MAX_PIECES = 150


# The most headers, and bytes of them, a request may carry (vLLM's --h11-max-header-count and
# --h11-max-incomplete-event-size).
MAX_HEADERS = 20
MAX_HEADER_BYTES = 4096


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        "--header-read-timeout", TIMEOUT, "--body-read-timeout", TIMEOUT, "--send-timeout", TIMEOUT,
        "--h11-max-header-count", str(MAX_HEADERS), "--h11-max-incomplete-event-size", str(MAX_HEADER_BYTES),
    )  # fmt: skip


def _connect(server: ServerProcess, receive_buffer: int | None = None) -> socket.socket:
    address = urlsplit(server.url)
    sock = socket.socket()
    if receive_buffer is not None:
        # Before connecting, so that the window the server may fill stays this small.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect((address.hostname, address.port))
    return sock


def _rest(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as closing)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _one_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _trickle_until_closed(sock: socket.socket, piece: bytes) -> bytes:
    """Send `piece` every TRICKLE_S until the server answers or closes; returns what it sent back."""
    sock.settimeout(TRICKLE_S)
    try:
        for _ in range(MAX_PIECES):
            try:
                first = sock.recv(65536)
            except TimeoutError:
                try:
                    sock.sendall(piece)
                except OSError:  # it has closed
                    break
                continue
            sock.settimeout(30)
            return first + _rest(sock) if first else b""
        else:
            raise AssertionError("the server kept a trickling connection open")
    except ConnectionResetError:
        return b""
    sock.settimeout(30)
    return _rest(sock)


def _timed_out(answer: bytes) -> None:
    """A 408 in OpenAI's shape, or a plain close."""
    if answer:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"]["type"] == "timeout_error"


def _post_head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def _served(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 200, response.text


def test_trickled_headers_are_cut_off(server: ServerProcess) -> None:
    with RequestBeside(server):
        slow = _connect(server)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        # Others are served meanwhile.
        _served(server)
        _timed_out(_trickle_until_closed(slow, b"X-Slow: 1\r\n"))
        slow.close()
        # On a kept-alive connection, the clock starts again once a response is sent.
        kept = _connect(server)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        assert _one_response(kept).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        _timed_out(_trickle_until_closed(kept, b"X-Slow: 1\r\n"))
        kept.close()


def _get_with_headers(server: ServerProcess, headers: list[bytes]) -> bytes:
    """GET /v1/models with Host and these header lines, on a connection of its own; what the server sent
    until it closed or answered."""
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n" + b"".join(headers) + b"\r\n")
        return _one_response(sock)


def test_requests_with_too_many_or_too_long_headers_are_refused(server: ServerProcess) -> None:
    with RequestBeside(server):
        at_limit = [f"X-Header-{index}: {index}\r\n".encode() for index in range(MAX_HEADERS - 1)]
        assert _get_with_headers(server, at_limit).startswith(b"HTTP/1.1 200")
        head, _, body = _get_with_headers(server, [*at_limit, b"X-One-More: 1\r\n"]).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431") and b"connection: close" in head.lower()
        assert f"the request has {MAX_HEADERS + 1} headers" in json.loads(body)["error"]["message"]
        long_value = b"X-Long: " + b"a" * (MAX_HEADER_BYTES // 2) + b"\r\n"
        assert _get_with_headers(server, [long_value]).startswith(b"HTTP/1.1 200")
        # Headers that pass the limit before they are whole are not buffered further.
        with _connect(server) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Long: " + b"a" * MAX_HEADER_BYTES)
            assert _rest(sock).startswith(b"HTTP/1.1 400")


def test_trickled_bodies_get_408(server: ServerProcess) -> None:
    with RequestBeside(server):
        slow = _connect(server)
        slow.sendall(_post_head(1000) + b"{")
        _served(server)
        answer = _trickle_until_closed(slow, b" ")
        slow.close()
        assert answer, "closed without an answer"
        head_bytes, _, body = answer.partition(b"\r\n\r\n")
        assert head_bytes.startswith(b"HTTP/1.1 408") and b"connection: close" in head_bytes.lower()
        error = openai_error(httpx.Response(408, content=body), 408)
        assert error["type"] == "timeout_error" and "body" in error["message"]


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(server: ServerProcess) -> None:
    aborted = finished_count(server, "abort")
    # Large events (20 log probabilities per token, 8 sequences), far more than the sockets' buffers hold,
    # and more tokens than it could generate before they fill.
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "go",
            "max_tokens": 2000,
            "n": 8,
            "logprobs": 20,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with RequestBeside(server):
        stalled = _connect(server, receive_buffer=4096)
        stalled.sendall(_post_head(len(body)) + body)
        assert stalled.recv(64).startswith(b"HTTP/1.1 200")
        # ... and reads nothing more: the server must give up on it and abort its request.
        deadline = time.monotonic() + 60
        while finished_count(server, "abort") == aborted:
            assert time.monotonic() < deadline, (
                "the request of a client that stopped reading was never aborted"
            )
            time.sleep(0.1)
        _served(server)
    stalled.close()
    assert finished_count(server, "abort") == aborted + 1
    # Its KV blocks are free again once the request beside has ended.
    wait_idle(server)
