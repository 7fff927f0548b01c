"""The official openai SDK against a real server: sync and async, streamed and not, chat and completions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from server_checks import assert_itself_first
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from pathlib import Path

    from servers import ServerProcess

MODEL_NAME = "tiny"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def async_client_factory(api_server: ServerProcess) -> Callable[[], openai.AsyncOpenAI]:
    url, key = f"{api_server.url}/v1", api_server.api_key
    return lambda: openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]


def test_completion_has_usage_and_length_finish(client: openai.OpenAI, api_server: ServerProcess) -> None:
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=7, **GREEDY
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert choice.finish_reason == "length"
    assert choice.text
    prompt_tokens = httpx.post(
        f"{api_server.url}/tokenize", json={"prompt": "Once upon a time"}, headers=api_server.headers()
    ).json()["count"]
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == prompt_tokens + 7
    # Counted only with --enable-prompt-tokens-details.
    assert completion.usage.prompt_tokens_details is None


def test_streamed_completion_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 12, **GREEDY}
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == whole.text
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_completion_multi_turn_with_system_prompt(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more."}],
        },
    ]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, **GREEDY)
    assert chat.object == "chat.completion"
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 6
    # The template renders every turn, so the prompt is longer than the last message alone.
    assert chat.usage.prompt_tokens > 10


def test_streamed_chat_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 10,
        **GREEDY,
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]


def test_n_seed_and_logprobs(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "Seeds", "max_tokens": 5, "n": 3, "seed": 7, "logprobs": 2}
    first = client.completions.create(temperature=1.0, **kwargs)
    second = client.completions.create(temperature=1.0, **kwargs)
    assert sorted(choice.index for choice in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    for choice in first.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 5
        assert all(logprob <= 0 for logprob in choice.logprobs.token_logprobs)
        assert_itself_first(choice.logprobs, 2)
    # Sampled at temperature 1, some token is not among the two likeliest: its top_logprobs hold three.
    assert any(len(top) == 3 for choice in first.choices for top in choice.logprobs.top_logprobs)

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(top.logprob for top in entry.top_logprobs))


def test_batch_of_prompts(client: openai.OpenAI) -> None:
    texts = client.completions.create(model=MODEL_NAME, prompt=["one", "two"], max_tokens=3, n=2, **GREEDY)
    assert sorted(choice.index for choice in texts.choices) == [0, 1, 2, 3]
    alone = client.completions.create(model=MODEL_NAME, prompt="two", max_tokens=3, **GREEDY)
    assert texts.choices[2].text == texts.choices[3].text == alone.choices[0].text
    token_lists = client.completions.create(
        model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, **GREEDY
    )
    assert token_lists.usage.prompt_tokens == 5
    assert token_lists.usage.completion_tokens == 6


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "stop here", "max_tokens": 12, **GREEDY}
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[4:7]
    assert stop.strip(), f"pick a prompt whose output has a usable stop string, got {text!r}"
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_async_client_streams_concurrently(async_client_factory: Callable[[], openai.AsyncOpenAI]) -> None:
    async def run() -> list[str]:
        async with async_client_factory() as client:

            async def one(prompt: str) -> str:
                stream = await client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=8,
                    stream=True,
                    **GREEDY,
                )
                return "".join(
                    [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
                )

            async def whole(prompt: str) -> str:
                completion = await client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=8, **GREEDY
                )
                return completion.choices[0].text

            streamed = await asyncio.gather(*(one(f"prompt {i}") for i in range(6)))
            completions = await asyncio.gather(*(whole(f"prompt {i}") for i in range(3)))
            return [*streamed, *completions]

    results = asyncio.run(run())
    assert len(results) == 9
    assert all(results[:6]) and all(results[6:])


def test_priority_field_and_header_are_accepted(client: openai.OpenAI, api_server: ServerProcess) -> None:
    client.completions.create(model=MODEL_NAME, prompt="p", max_tokens=2, extra_body={"priority": "critical"})
    client.completions.create(
        model=MODEL_NAME, prompt="p", max_tokens=2, extra_headers={"x-kvfleet-priority": "batch"}
    )
    client.completions.create(model=MODEL_NAME, prompt="p", max_tokens=2, extra_body={"priority": 1})
    metrics = httpx.get(f"{api_server.url}/metrics").text
    for tier in ("critical", "high", "batch"):
        assert (
            f'kvfleet:requests_finished_total{{finished_reason="length",model_name="{MODEL_NAME}",tier="{tier}"}}'
            in metrics
        )


def test_tokenize_and_detokenize_round_trip(api_server: ServerProcess) -> None:
    headers = api_server.headers()
    tokens = httpx.post(f"{api_server.url}/tokenize", json={"prompt": "hello world"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    text = httpx.post(
        f"{api_server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers
    ).json()
    assert "hello world" in text["prompt"]
    chat = httpx.post(
        f"{api_server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=headers
    ).json()
    assert chat["count"] > 1


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def test_continuous_usage_counts_each_choices_tokens_in_every_chunk(
    api_server: ServerProcess, tiny_llama: Path
) -> None:
    """vLLM's continuous_usage_stats (with include_usage): every chunk carries its choice's usage so far,
    its prompt's tokens and the tokens the choice has streamed (a chat's role chunk none); the last chunk
    holds the whole request's. Without include_usage it adds nothing, as in vLLM."""
    prompts = ["Once upon a time", "The fox"]
    body: dict[str, object] = {
        "model": MODEL_NAME,
        "prompt": prompts,
        "max_tokens": 5,
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream(
        "POST", f"{api_server.url}/v1/completions", json=body, headers=api_server.headers(), timeout=60
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    *chunks, last = events
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt_tokens = [len(tokenizer(text).input_ids) for text in prompts]
    streamed: dict[int, int] = {}
    for event in chunks:
        (choice,) = event["choices"]
        index = choice["index"]
        streamed[index] = streamed.get(index, 0) + len(choice["token_ids"])
        assert event["usage"] == _usage(prompt_tokens[index // 2], streamed[index])
    assert sorted(streamed) == [0, 1, 2, 3]
    # The request's: each prompt counted once, as in the answer unstreamed.
    assert last["choices"] == [] and last["usage"] == _usage(sum(prompt_tokens), sum(streamed.values()))
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{api_server.url}/v1/chat/completions",
        json={**chat, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        headers=api_server.headers(),
    ) as response:
        usages = [
            json.loads(line[6:])["usage"] for line in response.iter_lines() if line.startswith("data: {")
        ]
    assert usages[0]["completion_tokens"] == 0 and usages[-1]["completion_tokens"] == 3
    only = {"include_usage": False, "continuous_usage_stats": True}
    with httpx.stream(
        "POST",
        f"{api_server.url}/v1/chat/completions",
        json={**chat, "stream_options": only},
        headers=api_server.headers(),
    ) as response:
        assert all("usage" not in line for line in response.iter_lines())
