"""A client that goes away aborts its request at once: generation stops and its KV blocks are freed.

That the blocks are freed at once is checked on the engine core (tests/runtime/engine/test_engine_core.py);
here, through a real server, the request must stop far short of where it was going.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import ServerProcess

# As long as the tiny model's context allows, so that it is still running whenever the client leaves.
MAX_TOKENS = 2040


def _wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = metrics["kvfleet:num_requests_running"] == 0 and metrics["kvfleet:num_requests_waiting"] == 0
        if idle and metrics["kvfleet:kv_cache_usage_perc"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the request is still running after the disconnect: {metrics}")
        time.sleep(0.01)


def _finished(server: ServerProcess, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    prefix = f'vllm:request_success_total{{finished_reason="{reason}",model_name="tiny"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def _leave_mid_request(server: ServerProcess, stream: bool) -> None:
    """Send a long request, and go away once the server is generating it."""
    body = {
        "model": "tiny",
        "prompt": "go on",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as client:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                chunks = 0
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 3:
                        await _assert_running(server)
                        # Leaving the iteration closes the response, and with it the connection.
                        break
        else:
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            while (await asyncio.to_thread(server.metrics))["kvfleet:num_requests_running"] < 1:
                assert not request.done(), "the request finished before the client could leave"
                await asyncio.sleep(0.005)
            await _assert_running(server)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request


async def _assert_running(server: ServerProcess) -> None:
    metrics = await asyncio.to_thread(server.metrics)
    assert metrics["kvfleet:num_requests_running"] == 1 and metrics["kvfleet:kv_cache_usage_perc"] > 0


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_disconnect_aborts_and_frees_blocks(api_server: ServerProcess, stream: bool) -> None:
    _wait_idle(api_server)
    before = api_server.metrics().get("vllm:generation_tokens_total", 0.0)
    aborted_before = _finished(api_server, "abort")
    asyncio.run(_leave_mid_request(api_server, stream))
    after = _wait_idle(api_server)
    generated = after["vllm:generation_tokens_total"] - before
    assert 0 < generated < MAX_TOKENS / 2, "the request ran on after its client left"
    assert _finished(api_server, "abort") == aborted_before + 1
