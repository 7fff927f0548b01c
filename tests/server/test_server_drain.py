"""SIGTERM drains: /ready goes false, new requests get 503, in-flight requests finish (up to the drain
timeout; the rest are handed back with a `draining` error event that the fleet gateway resumes elsewhere),
and the process exits 0."""

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
from kvfleet.contract.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from servers import ServerProcess

# Long enough to be still streaming when the signal comes, short enough to finish within the drain.
SHORT_TOKENS = 300
# As long as the context allows: no machine gets through it within IMPATIENT_DRAIN_S.
LONG_TOKENS = 2040
# The same for a chat, whose template makes the prompt longer.
LONG_CHAT_TOKENS = 1900
PATIENT_DRAIN_S = 120.0
IMPATIENT_DRAIN_S = 1.0


# As the fleet gateway streams from a replica: token ids in every chunk, usage at the end.
GATEWAY_FIELDS = {"return_token_ids": True, "stream_options": {"include_usage": True}}
# How late the hand-back may come after the drain timeout, and the exit after it, on a loaded machine.
HANDBACK_SLACK_S = 3.0
EXIT_AFTER_HANDBACK_S = 12.0


def _stream_events(
    url: str, max_tokens: int, started: threading.Event, events: list[dict], raw: list[str], chat: bool
) -> None:
    """Streams a completion (or a chat completion) into `events`, and every line it received into `raw`."""
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    if chat:
        route = "chat/completions"
        body |= {**GATEWAY_FIELDS, "messages": [{"role": "user", "content": "drain"}]}
    else:
        route = "completions"
        body["prompt"] = "drain"
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            raw.append(line)
            if line.startswith("data: {"):
                events.append({**json.loads(line[len("data: ") :]), "received": time.monotonic()})
                started.set()
            elif line == "data: [DONE]":
                events.append({"done": True})


@pytest.fixture(scope="module")
def servers(start_server: Callable[..., ServerProcess]) -> tuple[ServerProcess, ServerProcess]:
    """(patient, impatient): drain timeouts that in-flight requests always, and never, finish within."""
    patient = start_server("--shutdown-timeout", str(PATIENT_DRAIN_S), wait=False)
    # kvfleet's older name for vLLM's --shutdown-timeout, which manifests may still carry.
    impatient = start_server("--drain-timeout", str(IMPATIENT_DRAIN_S), wait=False)
    patient.wait_ready()
    impatient.wait_ready()
    return patient, impatient


def _start_streams(
    server: ServerProcess, *max_tokens: int, chat: bool = False
) -> tuple[list[threading.Thread], list[list[dict]], list[list[str]]]:
    """Streams that have each received their first chunk: their threads, events and raw lines."""
    threads, events, raws, started = [], [], [], []
    for tokens in max_tokens:
        events.append([])
        raws.append([])
        started.append(threading.Event())
        args = (server.url, tokens, started[-1], events[-1], raws[-1], chat)
        threads.append(threading.Thread(target=_stream_events, args=args))
        threads[-1].start()
    assert all(event.wait(60) for event in started), server.log_tail()
    return threads, events, raws


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
    threads, (first, second), _ = _start_streams(server, SHORT_TOKENS, SHORT_TOKENS)
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


def test_sigterm_hands_back_what_the_drain_timeout_leaves(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    server = servers[1]
    threads, (events,), _ = _start_streams(server, LONG_TOKENS)
    chat_threads, (chat_events,), (chat_lines,) = _start_streams(server, LONG_CHAT_TOKENS, chat=True)
    signalled = time.monotonic()
    _sigterm_and_check_draining(server)
    assert server.process.wait(60) == 0, server.log_tail()
    exited = time.monotonic()
    assert exited - signalled >= IMPATIENT_DRAIN_S
    for thread in threads + chat_threads:
        thread.join(10)
    for stream in (events, chat_events):
        # Cut short with an OpenAI-shaped error event, then the end of the stream.
        assert stream[-1] == {"done": True}
        assert stream[-2]["error"]["code"] == "draining"
        assert _finish_reasons(stream) == []
        # Handed back as soon as the drain timeout passed, and the process gone soon after.
        handed_back = stream[-2]["received"]
        assert handed_back - signalled < IMPATIENT_DRAIN_S + HANDBACK_SLACK_S
        assert exited - handed_back < EXIT_AFTER_HANDBACK_S
    # What a gateway reads: tokens with their ids, then one `data:` event holding only the error (the
    # service's own shape and status type), then [DONE] and the end of the stream.
    events_received = [line for line in chat_lines if line]
    assert events_received[-1] == "data: [DONE]"
    assert (
        events_received[-2]
        == ServiceUnavailableError(chat_events[-2]["error"]["message"], code="draining").to_sse().strip()
    )
    assert all(line.startswith("data: {") for line in events_received[:-2])
    generated = [c for e in chat_events[:-2] for c in e.get("choices", []) if c.get("token_ids")]
    assert generated, "tokens streamed before the hand-back"
