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
from server_checks import finished_count, wait_idle

if TYPE_CHECKING:
    from servers import ServerProcess

# As long as the tiny model's context allows, so that it is still running whenever the client leaves.
MAX_TOKENS = 2040


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
    wait_idle(api_server)
    before = api_server.metrics().get("vllm:generation_tokens_total", 0.0)
    aborted_before = finished_count(api_server, "abort")
    asyncio.run(_leave_mid_request(api_server, stream))
    after = wait_idle(api_server)
    generated = after["vllm:generation_tokens_total"] - before
    assert 0 < generated < MAX_TOKENS / 2, "the request ran on after its client left"
    assert finished_count(api_server, "abort") == aborted_before + 1


def test_a_beam_search_whose_client_leaves_stops_its_steps(api_server: ServerProcess) -> None:
    """A beam search runs a request per beam at each step: once its client has gone, no step follows."""
    wait_idle(api_server)

    def generated() -> float:
        return api_server.metrics().get("vllm:generation_tokens_total", 0.0)

    before = generated()

    async def leave() -> None:
        body = {"model": "tiny", "prompt": "go on", "max_tokens": MAX_TOKENS, "n": 2, "use_beam_search": True}
        async with httpx.AsyncClient(
            base_url=api_server.url, headers=api_server.headers(), timeout=60
        ) as client:
            request = asyncio.create_task(client.post("/v1/completions", json={**body, "ignore_eos": True}))
            while await asyncio.to_thread(generated) < before + 20:
                assert not request.done(), "the search finished before the client could leave"
                await asyncio.sleep(0.005)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave())
    left_at = wait_idle(api_server)["vllm:generation_tokens_total"]
    time.sleep(1.0)
    assert generated() == left_at < before + MAX_TOKENS, "the search went on after its client left"
