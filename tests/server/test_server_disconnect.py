"""A client that goes away aborts its request at once: generation stops and its KV blocks are freed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import ServerProcess

MAX_TOKENS = 1500
# Tokens the request may still get after the client is gone: the step in flight, and the moment the
# server needs to notice, on a busy machine. Far below MAX_TOKENS, which it would reach otherwise.
TOKENS_AFTER_DISCONNECT_BOUND = 40


def _wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = metrics["kvfleet:num_requests_running"] == 0 and metrics["kvfleet:num_requests_waiting"] == 0
        if idle and metrics["kvfleet:kv_cache_usage_perc"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the request is still running after the disconnect: {metrics}")
        time.sleep(0.05)


def _long_request(stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": "go on",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_disconnect_aborts_and_frees_blocks(api_server: ServerProcess, stream: bool) -> None:
    _wait_idle(api_server)
    before = api_server.metrics()
    aborted_before = _finished(api_server, "abort")
    with httpx.Client(base_url=api_server.url, headers=api_server.headers()) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=_long_request(True), timeout=30) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                received = sum(
                    1 for _, line in zip(range(6), lines, strict=False) if line.startswith("data: ")
                )
                assert received >= 3
                running = api_server.metrics()
                assert running["kvfleet:num_requests_running"] == 1
                assert running["kvfleet:kv_cache_usage_perc"] > 0
                at_disconnect = running["vllm:generation_tokens_total"]
            # Leaving the block closes the connection mid-stream.
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=_long_request(False), timeout=1.5)
            at_disconnect = api_server.metrics()["vllm:generation_tokens_total"]
    after = _wait_idle(api_server)
    generated = after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
    assert 0 < generated < MAX_TOKENS / 2, "the request ran on after its client left"
    assert after["vllm:generation_tokens_total"] - at_disconnect <= TOKENS_AFTER_DISCONNECT_BOUND
    assert _finished(api_server, "abort") == aborted_before + 1


def _finished(server: ServerProcess, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    prefix = f'vllm:request_success_total{{finished_reason="{reason}",model_name="tiny"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)
