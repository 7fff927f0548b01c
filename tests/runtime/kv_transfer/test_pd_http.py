"""vLLM's P/D protocol through real `kvfleet serve` processes: a prefill replica's answer carries
kv_transfer_params, a decode replica pulls the blocks and answers (streaming too) as the colocated engine
does; bad params get a 400 with a clear message; the transfers show in /metrics."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from pd_engines import kv_transfer_config

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest where"
MESSAGES = [{"role": "user", "content": "Tell me a long story about a fox and a dog in a forest."}]


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _streamed_text(url: str, body: dict[str, Any]) -> str:
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_prefill_then_decode_over_http(start_server: Callable[..., Any]) -> None:
    prefill = start_server("--kv-transfer-config", json.dumps(kv_transfer_config("kv_producer")))
    decode = start_server("--kv-transfer-config", json.dumps(kv_transfer_config("kv_consumer")))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    prefilled = _post(
        prefill.url,
        "/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert prefilled.status_code == 200, prefilled.text
    params = prefilled.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    decoded = _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params})
    assert decoded.status_code == 200, decoded.text
    assert "kv_transfer_params" not in decoded.json()
    colocated = _post(prefill.url, "/v1/completions", body).json()
    assert decoded.json()["choices"][0]["text"] == colocated["choices"][0]["text"]

    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat_prefilled = _post(
        prefill.url,
        "/v1/chat/completions",
        {**chat, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    ).json()
    chat_params = chat_prefilled["kv_transfer_params"]
    streamed = _streamed_text(decode.url, {**chat, "kv_transfer_params": chat_params})
    assert (
        streamed
        == _post(prefill.url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    )

    samples = decode.metrics()
    assert samples["kvfleet:kv_transfer_loads_total"] == 2
    # Each prompt's blocks up to its last token's, which the decode replica runs itself.
    prompt_lengths = [decoded.json()["usage"]["prompt_tokens"], chat_prefilled["usage"]["prompt_tokens"]]
    expected_blocks = sum(-(-(length - 1) // 16) for length in prompt_lengths)
    assert samples["kvfleet:kv_transfer_blocks_pulled_total"] == expected_blocks
    assert samples["vllm:nixl_bytes_transferred_count"] == 2
    assert samples["vllm:nixl_bytes_transferred_sum"] == samples["kvfleet:kv_transfer_bytes_pulled_total"] > 0
    # The prefill replica's core lets go of the pulled blocks on its own, with no request left to run.
    deadline = time.monotonic() + 10
    while prefill.metrics()["kvfleet:kv_transfer_blocks_held"] != 0:
        assert time.monotonic() < deadline, "the prefill replica still holds pulled blocks"
        time.sleep(0.1)


def test_bad_params_get_a_400(start_server: Callable[..., Any]) -> None:
    decode = start_server("--kv-transfer-config", json.dumps(kv_transfer_config("kv_consumer")))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
    remote = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 4000,
        "remote_block_ids": [1],
        "remote_request_id": "ab" * 16,
    }
    for params, message in (
        ({"do_remote_prefill": 1}, "do_remote_prefill must be true or false"),
        ({"do_remote_decode": True}, "takes no prefill calls"),
        (remote, "names 1 blocks"),
        (
            {**remote, "remote_host": "203.0.113.9", "remote_block_ids": [1, 2, 3]},
            "not in this replica's peer networks",
        ),
    ):
        answer = _post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params})
        assert answer.status_code == 400, (params, answer.text)
        assert message in answer.json()["error"]["message"]
    streamed_prefill = {**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}
    answer = _post(decode.url, "/v1/completions", streamed_prefill)
    assert answer.status_code == 400 and "a prefill call is not streamed" in answer.json()["error"]["message"]


def test_killing_the_prefill_replica_during_pulls_loses_no_request(start_server: Callable[..., Any]) -> None:
    prefill = start_server("--kv-transfer-config", json.dumps(kv_transfer_config("kv_producer")))
    consumer_config = kv_transfer_config("kv_consumer", load_timeout_s=5, connect_timeout_s=1)
    decode = start_server("--kv-transfer-config", json.dumps(consumer_config))
    bodies = [
        {"model": "tiny", "prompt": f"{PROMPT} {i} " * (1 + i % 4), "max_tokens": 6, "temperature": 0}
        for i in range(12)
    ]
    expected = [_post(prefill.url, "/v1/completions", body).json()["choices"][0]["text"] for body in bodies]
    params = [
        _post(
            prefill.url,
            "/v1/completions",
            {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        ).json()["kv_transfer_params"]
        for body in bodies
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = [
            pool.submit(_post, decode.url, "/v1/completions", {**body, "kv_transfer_params": p})
            for body, p in zip(bodies, params, strict=True)
        ]
        os.kill(prefill.pid, signal.SIGKILL)
        began = time.monotonic()
        results = [answer.result() for answer in answers]
    assert time.monotonic() - began < 30  # within the load and connect bounds, far from a hang
    assert [r.status_code for r in results] == [200] * len(bodies)
    assert [r.json()["choices"][0]["text"] for r in results] == expected
    samples = decode.metrics()
    fallbacks = sum(
        value for name, value in samples.items() if name == "vllm:nixl_num_failed_transfers_total"
    )
    assert samples["kvfleet:kv_transfer_loads_total"] + fallbacks == len(bodies)
    # Every block of the decode replica is back in its pool.
    deadline = time.monotonic() + 10
    while decode.metrics()["kvfleet:kv_cache_usage_perc"] != 0:
        assert time.monotonic() < deadline, "the decode replica still holds blocks"
        time.sleep(0.1)
