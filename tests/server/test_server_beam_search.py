"""vLLM's use_beam_search through the official openai SDK, against Transformers' beam search on the served
folder: completions (two prompts, streamed and not) and chat; and what a beam search does not take, refused
by name."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from beam_reference import transformers_beams
from server_checks import assert_itself_first

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
WIDTH = 3
STEPS = 5
# Every beam runs to its length, as Transformers' do with the end tokens ruled out.
BEAMS = {"use_beam_search": True, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=120
    )


def _tokens(api_server: ServerProcess, **body: Any) -> list[int]:
    answer = httpx.post(f"{api_server.url}/tokenize", json=body, headers=api_server.headers(), timeout=60)
    return answer.json()["tokens"]


def test_completions_find_transformers_beams_streamed_or_not(
    client: openai.OpenAI, api_server: ServerProcess, tiny_llama: Path
) -> None:
    prompts = ["Once upon a time", "The quick brown fox"]
    asked: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompts, "n": WIDTH, "max_tokens": STEPS}
    completion = client.completions.create(**asked, logprobs=2, extra_body=BEAMS)
    choices = sorted(completion.choices, key=lambda choice: choice.index)
    for number, prompt in enumerate(prompts):
        expected = transformers_beams(tiny_llama, _tokens(api_server, prompt=prompt), WIDTH, STEPS)
        found = choices[number * WIDTH : (number + 1) * WIDTH]
        assert [choice.token_ids for choice in found] == [tokens for tokens, _ in expected]  # type: ignore[attr-defined]
        for choice, (_, logprob) in zip(found, expected, strict=True):
            assert sum(choice.logprobs.token_logprobs) == pytest.approx(logprob, abs=1e-4)
            assert_itself_first(choice.logprobs, 2)
            assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == len(prompts) * WIDTH * STEPS
    # Streamed, the answer comes whole once the search ends: each choice's text and tokens in one chunk.
    streamed: dict[int, list[Any]] = {}
    for event in client.completions.create(**asked, stream=True, extra_body=BEAMS):
        for choice in event.choices:
            streamed.setdefault(choice.index, []).append(choice)
    for choice in choices:
        (only,) = streamed[choice.index]
        assert (only.text, only.token_ids, only.finish_reason) == (choice.text, choice.token_ids, "length")  # type: ignore[attr-defined]
        assert only.logprobs is None


def test_chat_finds_transformers_beams(
    client: openai.OpenAI, api_server: ServerProcess, tiny_llama: Path
) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        n=2,
        max_tokens=STEPS,
        extra_body=BEAMS,  # type: ignore[arg-type]
    )
    expected = transformers_beams(tiny_llama, _tokens(api_server, messages=messages), 2, STEPS)
    assert [choice.token_ids for choice in chat.choices] == [tokens for tokens, _ in expected]  # type: ignore[attr-defined]
    assert all(choice.logprobs is None for choice in chat.choices)


@pytest.mark.parametrize(
    ("route", "fields", "named"),
    [
        ("completions", {"stop": ["."]}, "stop"),
        ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
        ("completions", {"n": 11}, "n"),
        ("completions", {"n": 2, "logprobs": 5}, "logprobs"),
        ("completions", {"echo": True, "logprobs": 1}, "echo"),
        ("completions", {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ("completions", {"stream": True, "continuation": {"choices": []}}, "continuation"),
        ("completions", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_a_beam_search_does_not_take_is_refused_by_name(
    api_server: ServerProcess, route: str, fields: dict[str, Any], named: str
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2, "use_beam_search": True, **fields}
    body.update(
        {"prompt": "Once"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    answer = httpx.post(f"{api_server.url}/v1/{route}", json=body, headers=api_server.headers(), timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == named
