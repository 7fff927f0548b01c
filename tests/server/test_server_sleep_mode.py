"""vLLM's sleep mode over HTTP (`kvfleet serve --enable-sleep-mode`): /sleep frees the EngineCore's KV cache
(its resident memory falls by the cache's size), requests meanwhile get 503 `sleeping` with Retry-After,
/wake_up brings back the same greedy answers; requests in flight end (mode abort) or finish first (mode
wait); the operator's client drives them; without the flag the routes do not exist."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import pytest
from fastapi.testclient import TestClient
from kvfleet.operator.scrape import ScrapeTarget
from kvfleet.operator.sleepers import RuntimeSleepClient
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLM
from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.server.app import build_app
from kvfleet.runtime.server.state import ServerSettings, ServerState
from memory import proc_status_kb
from processes import descendants

if TYPE_CHECKING:
    from servers import ServerProcess

CORE_MODULE = "kvfleet.runtime.engine.core_proc"
# 128 MiB of KV cache for the tiny model (8 KiB a block): far above what else moves in the core's memory.
NUM_KV_BLOCKS = 16384
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    # kvfleet's older name for vLLM's --num-gpu-blocks-override: the memory the test measures is its blocks'.
    return start_server("--enable-sleep-mode", "--num-kv-blocks", str(NUM_KV_BLOCKS))


def _kv_cache_bytes(model: Path) -> int:
    """The cache's size from the model's shape: keys and values of every layer, float32, 16 tokens a block."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return NUM_KV_BLOCKS * 16 * per_token


def _core_rss_bytes(server: ServerProcess) -> int:
    (core,) = [pid for pid, command in descendants(server.pid).items() if CORE_MODULE in command]
    return proc_status_kb(core, "VmRSS") * 1024


def _completion(server: ServerProcess, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": server.model_name,
        "prompt": "the sleeping replica",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def _post(server: ServerProcess, path: str, **params: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", params=params, timeout=120)


def _sleep_states(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    states = {}
    for state in SLEEP_STATES:
        line = f'vllm:engine_sleep_state{{model_name="{server.model_name}",sleep_state="{state}"}} '
        (value,) = [row.removeprefix(line) for row in text.splitlines() if row.startswith(line)]
        states[state] = float(value)
    return states


def _is_sleeping(server: ServerProcess) -> bool:
    return httpx.get(f"{server.url}/is_sleeping", timeout=10).json()["is_sleeping"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_the_wake_up_answers_alike(
    server: ServerProcess, tiny_llama: Path, level: int
) -> None:
    before = _completion(server).json()["choices"][0]["token_ids"]
    resident = _core_rss_bytes(server)

    assert _post(server, "/sleep", level=level).status_code == 200
    freed = resident - _core_rss_bytes(server)
    assert freed >= _kv_cache_bytes(tiny_llama), f"{freed} bytes freed"
    assert _is_sleeping(server)
    assert _sleep_states(server) == {state: float(i == level) for i, state in enumerate(SLEEP_STATES)}
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 503
    refused = _completion(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "sleeping"
    assert int(refused.headers["Retry-After"]) > 0

    assert _post(server, "/wake_up").status_code == 200
    assert not _is_sleeping(server)
    assert _sleep_states(server)["awake"] == 1.0
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    assert _completion(server).json()["choices"][0]["token_ids"] == before


@pytest.mark.parametrize(("mode", "finishes"), [("abort", False), ("wait", True)])
def test_a_request_in_flight_ends_or_finishes_before_the_sleep(
    server: ServerProcess, mode: str, finishes: bool
) -> None:
    answered: dict[str, Any] = {}

    def long_request() -> None:
        answered["response"] = _completion(server, max_tokens=400)

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 60
    while server.metrics().get("kvfleet:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.02)
    assert _post(server, "/sleep", mode=mode).status_code == 200
    thread.join(60)
    response = answered["response"]
    if finishes:
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["token_ids"]) == 400
    else:
        assert response.status_code == 503 and response.json()["error"]["code"] == "sleeping"
    assert _is_sleeping(server)
    assert _post(server, "/wake_up").status_code == 200


def test_the_operators_client_sleeps_and_wakes_a_replica(server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    target = ScrapeTarget("pod", host, int(port))

    async def calls() -> list[bool]:
        async with aiohttp.ClientSession() as session:
            client = RuntimeSleepClient(session)
            seen = [await client.is_sleeping(target, None)]
            await client.sleep(target, None)
            seen.append(await client.is_sleeping(target, None))
            await client.wake_up(target, None)
            return [*seen, await client.is_sleeping(target, None)]

    assert asyncio.run(calls()) == [False, True, False]


def test_bad_levels_modes_and_tags_are_refused(server: ServerProcess) -> None:
    for path, params in [
        ("/sleep", {"level": 3}),
        ("/sleep", {"level": "deep"}),
        ("/sleep", {"mode": "keep"}),
        ("/wake_up", {"tags": "everything"}),
    ]:
        response = _post(server, path, **params)
        assert response.status_code == 400, (path, params, response.text)
    assert not _is_sleeping(server)


@pytest.mark.parametrize("enabled", [False, True])
def test_the_routes_exist_only_with_the_flag(tiny_llama: Path, enabled: bool) -> None:
    config = EngineConfig(model=str(tiny_llama), enable_sleep_mode=enabled)
    state = ServerState(ServerSettings("tiny"), AsyncLLM(config), ServerMetrics("tiny"))
    client = TestClient(build_app(state))  # outside a `with`: no lifespan, the engine is never started
    routes = set(client.get("/openapi.json").json()["paths"])
    if enabled:
        assert {"/sleep", "/wake_up", "/is_sleeping"} <= routes
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    else:
        assert not {"/sleep", "/wake_up", "/is_sleeping"} & routes
        assert client.get("/is_sleeping").status_code == 404
        assert client.post("/sleep").status_code == client.post("/wake_up").status_code == 404
