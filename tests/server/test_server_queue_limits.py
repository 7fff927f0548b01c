"""vLLM's queue limits on a real server that runs one sequence at a time: --max-num-queued-reqs refuses a
request that would take the unfinished sequences past it, --max-num-queued-tokens one that arrives while the
prompts still waiting for their first token hold that many tokens. Both answer 503 at once (streamed or not,
before the stream opens), count in vLLM's admission_rejections metric, and touch no request they hold; once
the queue drains, requests run again."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_checks import RUNNING, WAITING, occupied, openai_error, wait_idle
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from pathlib import Path

    from servers import ServerProcess

MAX_NUM_QUEUED_REQS = 3
MAX_NUM_QUEUED_TOKENS = 40
# A prompt that alone fills the token limit, and occupants short enough to leave it room in the context.
LONG_PROMPT = "one two three four five six seven eight nine ten " * 5
OCCUPANT_TOKENS = 1900


@pytest.fixture(scope="module")
def server(start_server: Any) -> ServerProcess:
    return start_server(
        "--max-num-seqs",
        "1",
        "--max-num-queued-reqs",
        str(MAX_NUM_QUEUED_REQS),
        "--max-num-queued-tokens",
        str(MAX_NUM_QUEUED_TOKENS),
    )


def _admission_rejections(server: ServerProcess) -> dict[str, float]:
    """vLLM's admission_rejections, by limit."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:admission_rejections"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


async def _ask(server: ServerProcess, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **fields}
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as client:
        return await client.post("/v1/completions", json=body)


def test_a_request_past_the_unfinished_sequences_limit_gets_a_503(server: ServerProcess) -> None:
    before = _admission_rejections(server)

    async def run() -> list[httpx.Response]:
        # The third occupant was admitted beside two: the limit holds three sequences.
        async with occupied(server, ["go on"] * MAX_NUM_QUEUED_REQS, OCCUPANT_TOKENS):
            answers = [await _ask(server), await _ask(server, n=2, stream=True)]
            metrics = await asyncio.to_thread(server.metrics)
            assert (metrics[RUNNING], metrics[WAITING]) == (1, MAX_NUM_QUEUED_REQS - 1)
        return answers

    for answer in asyncio.run(run()):
        error = openai_error(answer, 503)
        assert error["code"] == "max_num_queued_reqs" and "at most 3" in error["message"], error
    assert _admission_rejections(server)["max_num_queued_reqs"] == before.get("max_num_queued_reqs", 0) + 2
    wait_idle(server)
    assert _ask_now(server).status_code == 200


def test_a_request_behind_a_full_prefill_backlog_gets_a_503(server: ServerProcess, tiny_llama: Path) -> None:
    assert len(AutoTokenizer.from_pretrained(tiny_llama)(LONG_PROMPT).input_ids) >= MAX_NUM_QUEUED_TOKENS
    before = _admission_rejections(server)

    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with occupied(server, [LONG_PROMPT, "go on"], OCCUPANT_TOKENS):
            # The long prompt has had its first token, and one short one waits for its own: the backlog holds
            # no more than that.
            beside_short = await _ask(server, max_tokens=1, timeout=0.5)
        async with occupied(server, ["go on", LONG_PROMPT], OCCUPANT_TOKENS):
            refused = await _ask(server)
            refused_stream = await _ask(server, stream=True)
        return beside_short, refused, refused_stream

    beside_short, refused, refused_stream = asyncio.run(run())
    # Admitted behind the short prompt, it timed out in the queue instead.
    assert openai_error(beside_short, 408)["code"] == "timeout"
    for answer in (refused, refused_stream):
        error = openai_error(answer, 503)
        assert error["code"] == "max_num_queued_tokens", error
    assert (
        _admission_rejections(server)["max_num_queued_tokens"] == before.get("max_num_queued_tokens", 0) + 2
    )
    wait_idle(server)
    assert _ask_now(server).status_code == 200


def _ask_now(server: ServerProcess) -> httpx.Response:
    return asyncio.run(_ask(server))
