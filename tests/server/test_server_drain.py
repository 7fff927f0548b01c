"""SIGTERM drains: /ready goes false, new requests get 503, in-flight requests finish (up to the drain
timeout; the rest are failed), and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from servers import ServerProcess

# Long enough to be still streaming when the signal comes, short enough to finish within the drain.
SHORT_TOKENS = 300
# As long as the context allows: no machine gets through it within IMPATIENT_DRAIN_S.
LONG_TOKENS = 2040
PATIENT_DRAIN_S = 120.0
IMPATIENT_DRAIN_S = 1.0


def _stream_events(url: str, max_tokens: int, started: threading.Event, events: list[dict]) -> None:
    body = {"model": "tiny", "prompt": "drain", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append({**json.loads(line[len("data: ") :]), "received": time.monotonic()})
                started.set()
            elif line == "data: [DONE]":
                events.append({"done": True})


@pytest.fixture(scope="module")
def servers(start_server: Callable[..., ServerProcess]) -> tuple[ServerProcess, ServerProcess]:
    """(patient, impatient): drain timeouts that in-flight requests always, and never, finish within."""
    patient = start_server("--drain-timeout", str(PATIENT_DRAIN_S), wait=False)
    impatient = start_server("--drain-timeout", str(IMPATIENT_DRAIN_S), wait=False)
    patient.wait_ready()
    impatient.wait_ready()
    return patient, impatient


def _start_streams(
    server: ServerProcess, *max_tokens: int
) -> tuple[list[threading.Thread], list[list[dict]]]:
    """Streams that have each received their first chunk."""
    threads, events, started = [], [], []
    for tokens in max_tokens:
        events.append([])
        started.append(threading.Event())
        threads.append(
            threading.Thread(target=_stream_events, args=(server.url, tokens, started[-1], events[-1]))
        )
        threads[-1].start()
    assert all(event.wait(60) for event in started), server.log_tail()
    return threads, events


def _sigterm_and_check_draining(server: ServerProcess) -> None:
    os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/ready", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "/ready stayed true after SIGTERM"
        time.sleep(0.02)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    refused = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "late"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert "retry-after" in refused.headers


def _finish_reasons(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]


def test_sigterm_lets_in_flight_requests_finish(servers: tuple[ServerProcess, ServerProcess]) -> None:
    server = servers[0]
    threads, (first, second) = _start_streams(server, SHORT_TOKENS, SHORT_TOKENS)
    signalled = time.monotonic()
    _sigterm_and_check_draining(server)
    assert server.process.wait(PATIENT_DRAIN_S) == 0, server.log_tail()
    for thread in threads:
        thread.join(10)
    for events in (first, second):
        assert events[-1] == {"done": True}
        assert _finish_reasons(events) == ["length"]
        # The requests were in flight: they kept streaming during the drain.
        assert any(event["received"] > signalled for event in events[:-1])


def test_sigterm_fails_what_the_drain_timeout_leaves(servers: tuple[ServerProcess, ServerProcess]) -> None:
    server = servers[1]
    threads, (events,) = _start_streams(server, LONG_TOKENS)
    signalled = time.monotonic()
    _sigterm_and_check_draining(server)
    assert server.process.wait(60) == 0, server.log_tail()
    assert time.monotonic() - signalled >= IMPATIENT_DRAIN_S
    threads[0].join(10)
    # Cut short with an OpenAI-shaped error event, then the end of the stream.
    assert events[-1] == {"done": True}
    assert events[-2]["error"]["code"] == "draining"
    assert _finish_reasons(events) == []
