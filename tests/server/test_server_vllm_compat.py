"""A vLLM user's command line and clients, unchanged: `kvfleet serve` started the way vLLM's docs start `vllm
serve` (positional model, list forms, vLLM's flags, a --config file, --log-level after the subcommand),
called with the official openai SDK for vLLM's API extensions (return_token_ids, stop_reason,
chat_template_kwargs), the Responses API and embeddings, checked against the model folder's own tokenizer,
Transformers' rendering of the chat template and Transformers' hidden states."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import click
import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from click.testing import CliRunner
from kvfleet.gateway.model_tokenizers import ModelTokenizers
from kvfleet.gateway.prompt_blocks import ModelPrompts
from kvfleet.gateway.requests import CHAT_PATH
from kvfleet.runtime.lora.make_adapter import make_adapter
from ports import free_port
from servers import ServerProcess
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from kvfleet.cli import cli

ALLOWED_ORIGIN = "https://app.example"
ROOT_PATH = "/llm"
# What the model folder's generation_config.json recommends, beside its token ids.
GENERATION_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 6}
MAX_LOGPROBS = 3
# Qwen3's thinking switch and gpt-oss's reasoning effort, in a template of its own: the template, not the
# server, reads the variables.
CHAT_TEMPLATE = (
    "{% if tools %}### tools: {% for tool in tools %}{{ tool['function']['name'] }} {% endfor %}\n{% endif %}"
    "{% if reasoning_effort is defined %}### effort: {{ reasoning_effort }}\n{% endif %}"
    "{% for message in messages %}### {{ message['role'] }}:\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
# A sampled request whose settings the processed logprobs show: temperature and top_k (the model folder's
# generation defaults set no others); tokens by id, as the alternative a top_k of 2 rules out may share a
# text with one it keeps.
SAMPLED: dict[str, Any] = {
    "temperature": 0.8,
    "seed": 3,
    "extra_body": {
        "top_k": 2,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    },
}
PROMPT = "Once upon a time"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
# The engine's default --block-size: the prefix cache holds whole blocks.
BLOCK_SIZE = 16
# The server's --stream-interval: every stream of this module hands out its tokens two at a time at least.
STREAM_INTERVAL = 2


@pytest.fixture(scope="module")
def model_folder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vllm-compat") / "model"
    shutil.copytree(tiny_llama, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GENERATION_DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def server(
    model_folder: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("vllm-compat-server")
    template = root / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    first = make_adapter(tiny_llama, root / "first", rank=8, seed=1)
    second = make_adapter(tiny_llama, root / "second", rank=8, seed=2)
    port = free_port()
    # As vLLM's docs write it: the model first, list flags taking several values.
    command = [sys.executable, "-P", "-m", "kvfleet", "serve", str(model_folder)]
    command += ["--enable-lora", "--max-loras", "2", "--lora-modules", f"first={first}", f"second={second}"]
    command += [
        "--trust-remote-code",
        "--enforce-eager",
        "--kv-cache-dtype",
        "auto",
        "--disable-log-requests",
    ]
    command += [
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--generation-config",
        "auto",
        "--chat-template",
        str(template),
    ]
    command += ["--allowed-origins", json.dumps([ALLOWED_ORIGIN]), "--root-path", ROOT_PATH]
    command += ["--uvicorn-log-level", "info", "--log-level", "warning"]
    # The rest from a config file, as vLLM reads one: flags by name, lists, switches; a flag given above wins
    # over the file's value (max-logprobs).
    config = root / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "served-model-name": ["tiny", "tiny-alias"],
                "stream-interval": STREAM_INTERVAL,
                "long-prefill-token-threshold": 64,
                "max-logprobs": MAX_LOGPROBS + 5,
                # vLLM's production switches: no access log (over kvfleet's own), no stats lines, no schema.
                "access-log": True,
                "disable-uvicorn-access-log": True,
                "disable-log-stats": True,
                "disable-fastapi-docs": True,
                "load-format": "safetensors",
                "tokenizer-mode": "hf",
                "enable-prompt-tokens-details": True,
                "enable-force-include-usage": True,
                "enable-request-id-headers": True,
                "enable-server-load-tracking": True,
                "enable-tokenizer-info-endpoint": True,
                "trust-request-chat-template": True,
                "structured-outputs-config": {"backend": "xgrammar", "disable_any_whitespace": True},
                "logprobs-mode": "processed_logprobs",
                "log-error-stack": True,
                # What kvfleet always does, as vLLM's manifests may ask for it.
                "disable-custom-all-reduce": True,
                "disable-cascade-attn": True,
                "no-async-scheduling": True,
                "model-impl": "vllm",
                "enable-prompt-embeds": True,
            }
        )
    )
    command += ["--config", str(config)]
    command += ["--dtype", "float32", "--num-gpu-blocks-override", "512"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    log_path = root / "server.log"
    with log_path.open("wb") as log:
        # vLLM's switch for its Responses API store, as a vLLM deployment sets it.
        env = {**os.environ, "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    started = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, api_key=None)
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_folder: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_folder)


def _gateway_prompts(url: str) -> ModelPrompts:
    """The fleet gateway's preparation of the model's prompts, from the server's tokenizer answer."""

    async def fetch() -> ModelPrompts:
        tokenizers = ModelTokenizers({})
        try:
            async with aiohttp.ClientSession() as session:
                async with asyncio.timeout(60):
                    while (prompts := tokenizers.get("tiny", [url], session)) is None:
                        await asyncio.sleep(0.05)
                return prompts
        finally:
            await tokenizers.close()

    return asyncio.run(fetch())


def _rendered(tokenizer: Any, messages: Any = MESSAGES, **render_kwargs: Any) -> list[int]:
    """A conversation's prompt as Transformers renders it with the module's template (by default opening the
    answer's turn)."""
    render_kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=True, **render_kwargs
    )["input_ids"]


def test_every_served_name_and_adapter_is_listed_and_answers_under_its_name(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    assert {model.id for model in client.models.list().data} == {"tiny", "tiny-alias", "first", "second"}
    for name in ("tiny", "tiny-alias", "second"):
        completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, **GREEDY)
        assert completion.model == name
    # The HTTP server logs at --uvicorn-log-level, the rest at --log-level (given after the subcommand, over
    # the command's default of info).
    log = server.log_path.read_text()
    assert "Uvicorn running on" in log
    assert " INFO kvfleet" not in log
    # No access log, and no schema.
    assert '"POST /llm/v1/completions' not in log and '"POST /v1/completions' not in log
    assert httpx.get(f"{server.url}/openapi.json", timeout=10).status_code == 404


def test_completion_token_ids_are_the_tokenizers(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, **GREEDY}
    kwargs["extra_body"] = {**kwargs["extra_body"], "return_token_ids": True}
    completion = client.completions.create(**kwargs)
    (choice,) = completion.choices
    assert choice.prompt_token_ids == tokenizer(PROMPT).input_ids  # type: ignore[attr-defined]
    token_ids = choice.token_ids  # type: ignore[attr-defined]
    assert len(token_ids) == completion.usage.completion_tokens == 8
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice.text
    chunks = [chunk.choices[0] for chunk in client.completions.create(stream=True, **kwargs) if chunk.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids  # type: ignore[attr-defined]
    assert [t for chunk in chunks for t in chunk.token_ids] == token_ids  # type: ignore[attr-defined]
    # Not asked for, not sent.
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **GREEDY).choices[0]
    assert "token_ids" not in (plain.model_extra or {})


@pytest.mark.parametrize(("asked", "interval"), [(None, STREAM_INTERVAL), (1, STREAM_INTERVAL), (5, 5)])
def test_streams_hand_out_their_tokens_at_the_stream_interval(
    client: openai.OpenAI, asked: int | None, interval: int
) -> None:
    """The first token at once, then the server's interval or the request's larger one, and the rest with
    the finish; joined, the same tokens and text as the answer not streamed. Two choices count apart."""
    extra = {**GREEDY["extra_body"], "return_token_ids": True}
    if asked is not None:
        extra["stream_interval"] = asked
    max_tokens = 12
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "n": 2, **GREEDY}
    answer = client.completions.create(**{**kwargs, "extra_body": extra})
    stream = client.completions.create(**{**kwargs, "extra_body": extra}, stream=True)
    chunks = [choice for chunk in stream for choice in chunk.choices]
    full, rest = divmod(max_tokens - 1, interval)
    for index in (0, 1):
        mine = [chunk for chunk in chunks if chunk.index == index]
        token_ids = [chunk.token_ids for chunk in mine]  # type: ignore[attr-defined]
        assert [len(ids) for ids in token_ids] == [1] + [interval] * full + ([rest] if rest else [])
        assert mine[-1].finish_reason == "length"
        assert [t for ids in token_ids for t in ids] == answer.choices[index].token_ids  # type: ignore[attr-defined]
        assert "".join(chunk.text for chunk in mine) == answer.choices[index].text


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client: openai.OpenAI) -> None:
    """The second time a prompt comes, its whole blocks but the one holding its last token are the cache's
    (the last token is computed again for its logits); a stream ends with its usage unasked. The Responses
    API counts them too."""
    prompt = list(range(100, 100 + 2 * BLOCK_SIZE + 8))
    cached = 2 * BLOCK_SIZE
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **GREEDY}
    first, second = (client.completions.create(**kwargs).usage for _ in range(2))
    assert first.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert second.prompt_tokens_details.cached_tokens == cached  # type: ignore[union-attr]
    *_, last = client.completions.create(stream=True, **kwargs)
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens == cached  # type: ignore[union-attr]
    # Two prompts at once count apart, and add up.
    twice = client.completions.create(**{**kwargs, "prompt": [prompt, prompt[::-1]]}).usage
    assert twice.prompt_tokens_details.cached_tokens == cached  # type: ignore[union-attr]
    text = " ".join(["story"] * 3 * BLOCK_SIZE)
    responses = [client.responses.create(model="tiny", input=text, max_output_tokens=2) for _ in range(2)]
    input_tokens = responses[1].usage.input_tokens  # type: ignore[union-attr]
    assert (
        responses[1].usage.input_tokens_details.cached_tokens == (input_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    )  # type: ignore[union-attr]


def test_responses_carry_request_ids_and_load_counts_the_requests_in_flight(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}
    given = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=60
    )
    assert given.headers["x-request-id"] == "trace-7"
    made = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    # A request is counted until its response is sent, which may end just after the client has it.
    _wait_for_load(server, 0)
    # Long enough to be still sending when asked; then the client goes, and so does the request.
    long = {**body, "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as stream:
        assert stream.headers["x-request-id"]
        lines = stream.iter_lines()  # held: a dropped iterator would close the stream
        next(lines)
        assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 1}
    _wait_for_load(server, 0)


def test_answer_ids_are_the_clients_request_ids_as_vllm_makes_them(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """vLLM's: X-Request-Id, else the body's request_id, after the route's prefix (the Responses API's body
    id as it is). Requests in flight may share one, and run apart."""
    chat: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
    }
    chat["temperature"] = 0.0
    alone = client.chat.completions.create(**chat, extra_body={"request_id": "order-12"})
    assert alone.id == "chatcmpl-order-12"
    headed = client.with_options(default_headers={"X-Request-Id": "trace-8"})
    assert (
        headed.chat.completions.create(**chat, extra_body={"request_id": "order-12"}).id == "chatcmpl-trace-8"
    )

    async def shared() -> list[tuple[set[str], str]]:
        async def streamed(sdk: openai.AsyncOpenAI) -> tuple[set[str], str]:
            chunks = await sdk.chat.completions.create(**chat, stream=True, extra_body={"request_id": "same"})
            ids, text = set(), ""
            async for chunk in chunks:
                ids.add(chunk.id)
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
            return ids, text

        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as sdk:
            return await asyncio.gather(*(streamed(sdk) for _ in range(3)))

    assert asyncio.run(shared()) == [({"chatcmpl-same"}, alone.choices[0].message.content)] * 3
    embedded = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": "tiny", "input": PROMPT, "request_id": "vec-1"},
        timeout=60,
    )
    assert embedded.json()["id"] == "embd-vec-1"
    kept = client.responses.create(
        model="tiny", input=PROMPT, max_output_tokens=2, extra_body={"request_id": "r7"}
    )
    assert kept.id == "r7" and client.responses.retrieve("r7").output_text == kept.output_text
    with pytest.raises(openai.ConflictError) as caught:
        client.responses.create(
            model="tiny", input=PROMPT, max_output_tokens=2, extra_body={"request_id": "r7"}
        )
    assert caught.value.body["param"] == "request_id"  # type: ignore[index]
    # What logs and headers could not carry (spaces, control characters, nothing) is refused in the body; in
    # the header, a tracing header's value, it is passed over for the body's id.
    for body_id in ("two words", "", "line\nbreak", "x" * 257):
        refused = httpx.post(
            f"{server.url}/v1/chat/completions", json={**chat, "request_id": body_id}, timeout=60
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "request_id"
    passed_over = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**chat, "request_id": "order-13"},
        headers={"X-Request-Id": "two words"},
        timeout=60,
    )
    assert passed_over.json()["id"] == "chatcmpl-order-13"


def _wait_for_load(server: ServerProcess, load: int) -> None:
    deadline = time.monotonic() + 30
    while (answer := httpx.get(f"{server.url}/load", timeout=10).json()) != {"server_load": load}:
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)


def test_a_stream_interval_below_one_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, stream=True, extra_body={"stream_interval": 0}
        )
    assert caught.value.body["param"] == "stream_interval"  # type: ignore[index]
    assert "stream_interval must be at least 1" in caught.value.body["message"]  # type: ignore[index]


def test_chat_token_ids_are_the_rendered_templates(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path
) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **GREEDY}
    kwargs["extra_body"] = {**kwargs["extra_body"], "return_token_ids": True}
    chat = client.chat.completions.create(**kwargs)
    rendered = tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert chat.prompt_token_ids == rendered  # type: ignore[attr-defined]
    (choice,) = chat.choices
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content  # type: ignore[attr-defined]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].prompt_token_ids == rendered  # type: ignore[attr-defined]
    # The first chunk (the role) carries the prompt's ids, the others each their new tokens'.
    streamed = [
        t for chunk in chunks for c in chunk.choices for t in (c.model_extra or {}).get("token_ids", [])
    ]
    assert streamed == choice.token_ids  # type: ignore[attr-defined]
    # A stream that holds text back to read tool calls from it still sends every token's id.
    calling = {**kwargs, "tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 40}
    call = client.chat.completions.create(**calling).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **calling))
    streamed = [
        t for chunk in chunks for c in chunk.choices for t in (c.model_extra or {}).get("token_ids", [])
    ]
    assert streamed == call.token_ids  # type: ignore[attr-defined]


def test_chat_template_kwargs_reach_the_template(
    server: ServerProcess, client: openai.OpenAI, tokenizer: Any
) -> None:
    def prompt_ids(template_kwargs: dict[str, Any] | None) -> list[int]:
        extra = {
            "return_token_ids": True,
            **({"chat_template_kwargs": template_kwargs} if template_kwargs else {}),
        }
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra)
        return chat.prompt_token_ids  # type: ignore[attr-defined]

    without_thinking = prompt_ids({"enable_thinking": False})
    assert without_thinking == _rendered(tokenizer, enable_thinking=False)
    assert prompt_ids({"enable_thinking": True}) == prompt_ids(None) == _rendered(tokenizer)
    assert without_thinking != _rendered(tokenizer)
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"] == without_thinking
    with pytest.raises(openai.BadRequestError) as caught:
        prompt_ids({"tokenize": False})
    assert caught.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_tools_reach_the_template_even_when_none_may_be_called(client: openai.OpenAI, tokenizer: Any) -> None:
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=1,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="none",
        extra_body={"return_token_ids": True},
    )
    with_tools = _rendered(tokenizer, tools=[WEATHER_TOOL])
    assert with_tools != _rendered(tokenizer)
    assert chat.prompt_token_ids == with_tools  # type: ignore[attr-defined]


def test_a_reply_is_continued_from_its_prefilled_start(
    server: ServerProcess, client: openai.OpenAI, tokenizer: Any
) -> None:
    """continue_final_message: the prompt ends within the last message, as Transformers renders it, and the
    answer goes on in its role."""
    messages: Any = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    expected = _rendered(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert expected != _rendered(tokenizer, messages, add_generation_prompt=False)
    going_on = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, extra_body=going_on)
    assert chat.prompt_token_ids == expected  # type: ignore[attr-defined]
    assert chat.choices[0].message.role == "assistant"
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    assert httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"] == expected
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, extra_body={"continue_final_message": True}
        )
    assert caught.value.body["param"] == "continue_final_message"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[], extra_body={"add_generation_prompt": False})
    assert caught.value.body["param"] == "messages"  # type: ignore[index]


def test_stop_reason_names_the_stop_string_or_token(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, **GREEDY}
    kwargs["extra_body"] = {**kwargs["extra_body"], "return_token_ids": True}
    free = client.completions.create(**kwargs).choices[0]
    assert (free.finish_reason, free.stop_reason) == ("length", None)  # type: ignore[attr-defined]
    stop_token = free.token_ids[4]  # type: ignore[attr-defined]
    by_token = client.completions.create(
        **{**kwargs, "extra_body": {**kwargs["extra_body"], "stop_token_ids": [stop_token]}}
    ).choices[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_token)  # type: ignore[attr-defined]
    stop_string = tokenizer.decode(free.token_ids[3:5]).strip() or free.text[-2:]  # type: ignore[attr-defined]
    assert stop_string in free.text
    by_string = client.completions.create(**kwargs, stop=[stop_string]).choices[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop_string)  # type: ignore[attr-defined]
    assert by_string.text == free.text[: free.text.index(stop_string)]
    chunks = list(client.completions.create(**kwargs, stop=[stop_string], stream=True))
    (finishing,) = [choice for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert (finishing.finish_reason, finishing.stop_reason) == ("stop", stop_string)  # type: ignore[attr-defined]


def test_generation_config_gives_the_defaults_requests_leave_unset(client: openai.OpenAI) -> None:
    messages: Any = MESSAGES
    unset = client.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == GENERATION_DEFAULTS["max_new_tokens"]
    greedy = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert unset.choices[0].message.content == greedy.choices[0].message.content
    asked = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert asked.usage.completion_tokens == 9
    sampled = {
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
        for seed in range(4)
    }
    assert sampled != {greedy.choices[0].message.content}, "sampling at temperature 1 differs from greedy"


def test_tokenizer_info_is_the_tokenizers_configuration_without_paths(
    server: ServerProcess, model_folder: Path, tokenizer: Any
) -> None:
    """GET /tokenizer_info (--enable-tokenizer-info-endpoint): what Transformers loaded, special tokens by
    their text, with the server's own chat template; nothing of where the files lie."""
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == CHAT_TEMPLATE  # --chat-template, over the folder's
    assert (info["bos_token"], info["eos_token"]) == (tokenizer.bos_token, tokenizer.eos_token)
    assert info["model_max_length"] == tokenizer.model_max_length
    added = {str(token_id): token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
    assert info["added_tokens_decoder"] == added and added
    assert str(model_folder) not in json.dumps(info)


def test_reasoning_effort_reaches_the_template_and_switches_thinking(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    """OpenAI's reasoning_effort, as vLLM serves it: the template's reasoning_effort variable, and
    enable_thinking false for "none" and true otherwise, unless chat_template_kwargs says."""
    cases = [
        ("none", None, {"reasoning_effort": "none", "enable_thinking": False}),
        ("low", None, {"reasoning_effort": "low", "enable_thinking": True}),
        ("high", {"enable_thinking": False}, {"reasoning_effort": "high", "enable_thinking": False}),
    ]
    for effort, requested, variables in cases:
        extra = {"return_token_ids": True, "chat_template_kwargs": requested}
        chat = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=1,
            reasoning_effort=effort,
            extra_body=extra,  # type: ignore[arg-type]
        )
        assert chat.prompt_token_ids == _rendered(tokenizer, **variables)  # type: ignore[attr-defined]


def test_a_trusted_request_template_renders_as_transformers_renders_it(
    server: ServerProcess, client: openai.OpenAI, tokenizer: Any
) -> None:
    """--trust-request-chat-template: a chat's own chat_template over the server's, on chat completions and
    /tokenize; one that does not compile is a 400."""
    template = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
    expected = tokenizer.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True)
    extra = {"chat_template": template, "return_token_ids": True}
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra)
    assert chat.prompt_token_ids == expected["input_ids"] != _rendered(tokenizer)  # type: ignore[attr-defined]
    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"model": "tiny", "messages": MESSAGES, "chat_template": template}
    )
    assert tokenized.json()["tokens"] == expected["input_ids"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"chat_template": "{% for %}"}
        )
    assert caught.value.body["param"] == "messages"  # type: ignore[index]


def test_truncate_prompt_tokens_keeps_the_side_asked_for(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path
) -> None:
    """vLLM's truncate_prompt_tokens: each prompt cut to that many tokens, its last ones kept with
    truncation_side "left", its first with "right", and its last by default whatever the tokenizer's own
    side (the tiny one's is "right"); -1 keeps what the context holds beside one token to generate. The
    answer is that of the cut prompt sent whole. Cut by default, a text keeps its beginning-of-text token,
    as Transformers' truncation on the left keeps it."""
    text = PROMPT + " in a land far away"
    prompt_ids = tokenizer(text).input_ids
    max_model_len = client.models.list().data[0].max_model_len  # type: ignore[attr-defined]
    assert tokenizer.truncation_side == "right"
    for side, kept in (("left", prompt_ids[-4:]), ("right", prompt_ids[:4]), (None, prompt_ids[-4:])):
        body = {**GREEDY["extra_body"], "truncate_prompt_tokens": 4, "return_token_ids": True}
        if side is not None:
            body["truncation_side"] = side
        cut = client.completions.create(
            model="tiny", prompt=prompt_ids, max_tokens=3, extra_body=body, temperature=0
        )
        whole = client.completions.create(model="tiny", prompt=kept, max_tokens=3, **GREEDY)
        assert cut.choices[0].prompt_token_ids == kept and cut.usage.prompt_tokens == 4  # type: ignore[attr-defined]
        assert cut.choices[0].text == whole.choices[0].text
    on_the_left = AutoTokenizer.from_pretrained(model_folder, truncation_side="left")
    kept = on_the_left(text, truncation=True, max_length=4).input_ids
    assert kept[0] == tokenizer.bos_token_id and kept[1:] == prompt_ids[-3:]
    extra = {**GREEDY["extra_body"], "truncate_prompt_tokens": 4, "return_token_ids": True}
    cut = client.completions.create(model="tiny", prompt=text, max_tokens=3, extra_body=extra, temperature=0)
    assert cut.choices[0].prompt_token_ids == kept  # type: ignore[attr-defined]
    body = {**GREEDY["extra_body"], "truncate_prompt_tokens": -1, "truncation_side": "left"}
    longest = client.completions.create(
        model="tiny",
        prompt=(prompt_ids * max_model_len)[: max_model_len + 7],
        max_tokens=1,
        extra_body=body,
        temperature=0,
    )
    assert (longest.usage.prompt_tokens, longest.usage.completion_tokens) == (max_model_len - 1, 1)
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5, "truncation_side": "left", "return_token_ids": True},
    )
    assert chat.prompt_token_ids == _rendered(tokenizer)[-5:]  # type: ignore[attr-defined]
    for bad, param in (
        ({"truncate_prompt_tokens": max_model_len + 1}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2, "truncation_side": "middle"}, "truncation_side"),
        # No room for the text's beginning-of-text token.
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=bad)
        assert caught.value.body["param"] == param  # type: ignore[index]


def test_each_of_the_generation_configs_end_tokens_ends_a_sequence(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path
) -> None:
    """generation_config.json names two end tokens, the tokenizer's and another (Llama 3's end of text): as
    Transformers' generate does, a sequence ends at either (at the other as at a stop token, its id the
    stop reason, as in vLLM), unless ignore_eos; a constrained output, once complete, ends at either too."""
    ends = json.loads((model_folder / "generation_config.json").read_text())["eos_token_id"]
    (other,) = [token for token in ends if token != tokenizer.eos_token_id]
    prompt_ids = tokenizer(PROMPT).input_ids
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        generated = model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=5, sequence_bias={(other,): 100.0}
        )
    expected = generated[0, len(prompt_ids) :].tolist()
    assert expected == [other]
    biased: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 5,
        "temperature": 0.0,
        "logit_bias": {str(other): 100},
    }
    (ended,) = client.completions.create(
        prompt=prompt_ids, **biased, extra_body={"return_token_ids": True}
    ).choices
    assert (ended.token_ids, ended.finish_reason, ended.stop_reason) == (expected, "stop", other)  # type: ignore[attr-defined]
    (ignored,) = client.completions.create(
        prompt=prompt_ids, **biased, extra_body={"return_token_ids": True, "ignore_eos": True}
    ).choices
    assert (ignored.token_ids, ignored.finish_reason) == ([other] * 5, "length")  # type: ignore[attr-defined]
    constrained = {"return_token_ids": True, "structured_outputs": {"choice": ["yes", "no"]}}
    (chosen,) = client.completions.create(prompt=prompt_ids, **biased, extra_body=constrained).choices
    assert chosen.text in ("yes", "no") and chosen.token_ids[-1] == other and chosen.stop_reason == other  # type: ignore[attr-defined]


def test_forced_usage_comes_with_every_chunk(server: ServerProcess) -> None:
    """This server forces usage into streams (--enable-force-include-usage): as vLLM's, it then puts each
    chunk's usage so far in every chunk too, asked for or not."""
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    completion_tokens = [event["usage"]["completion_tokens"] for event in events]
    assert completion_tokens[0] == 0 and completion_tokens[-2:] == [3, 3]


def test_tokenize_answers_the_pieces_when_asked(server: ServerProcess, tokenizer: Any) -> None:
    """vLLM's return_token_strs: each token's piece in the vocabulary, as Transformers converts it."""
    body = {"model": "tiny", "prompt": "日本 café", "return_token_strs": True}
    answer = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert "token_strs" not in httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30).json()


def test_max_logprobs_bounds_what_requests_ask(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS)
    assert all(len(top) == MAX_LOGPROBS for top in completion.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    assert caught.value.body["param"] == "logprobs"  # type: ignore[index]


def _saved(value: Any) -> str:
    """A tensor as vLLM's clients send prompt embeddings: base64 of what torch.save writes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_prompt_embeddings_are_continued_as_transformers_continues_them(
    server: ServerProcess, model_folder: Path, tokenizer: Any
) -> None:
    """vLLM's prompt_embeds, before the text prompts as vLLM runs them: one of no token, and a prompt's own
    embeddings ([1, tokens, hidden], as vLLM also takes them) beside its text."""
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    weight = model.get_input_embeddings().weight
    unseen = torch.randn(9, weight.shape[1], generator=torch.Generator().manual_seed(7)) * weight.std().item()
    token_ids = tokenizer(PROMPT).input_ids
    own = model.get_input_embeddings()(torch.tensor(token_ids)).detach()
    with torch.inference_mode():
        expected = [
            model.generate(
                inputs_embeds=embeddings[None], max_new_tokens=6, min_new_tokens=6, do_sample=False
            )[0].tolist()
            for embeddings in (unseen, own)
        ]
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "prompt_embeds": [_saved(unseen), _saved(own[None])],
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{server.url}{ROOT_PATH}/v1/completions", json=body, timeout=60).json()
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert [choice["token_ids"] for choice in choices[:2]] == expected
    # The text prompt, last, as it is answered alone.
    alone = httpx.post(
        f"{server.url}{ROOT_PATH}/v1/completions", json={**body, "prompt_embeds": None}, timeout=60
    ).json()
    assert choices[2]["token_ids"] == alone["choices"][0]["token_ids"]
    assert answer["usage"]["prompt_tokens"] == 9 + 2 * len(token_ids)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
        ({"prompt_embeds": _saved({"not": "a tensor"})}, "prompt_embeds", "must be a torch tensor"),
        # A pickle that would run code: refused by the weights-only loader, not run.
        (
            {"prompt_embeds": base64.b64encode(pickle.dumps(os.getpid)).decode()},
            "prompt_embeds",
            "could not be read as a saved torch tensor",
        ),
        (
            {"prompt_embeds": [_saved(torch.zeros(2, 64)), _saved(torch.zeros(2, 65))]},
            "prompt_embeds.1",
            "65",
        ),
        ({"prompt_embeds": _saved(torch.zeros(2, 64)), "echo": True}, "echo", "echo"),
        ({"prompt_embeds": _saved(torch.zeros(2, 64)), "prompt_logprobs": 1}, "prompt_logprobs", "prompt"),
        ({"prompt": None}, "prompt", "prompt or prompt_embeds"),
    ],
)
def test_prompt_embeddings_it_cannot_take_are_refused_by_field(
    server: ServerProcess, fields: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": "tiny", "prompt": "", "max_tokens": 2, **fields}
    response = httpx.post(f"{server.url}{ROOT_PATH}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_server_without_the_switch_refuses_prompt_embeddings(api_server: ServerProcess) -> None:
    body = {"model": api_server.model_name, "prompt_embeds": _saved(torch.zeros(2, 64)), "max_tokens": 2}
    response = httpx.post(
        f"{api_server.url}/v1/completions", json=body, headers=api_server.headers(), timeout=60
    )
    assert response.status_code == 400 and "--enable-prompt-embeds" in response.json()["error"]["message"]


def test_an_error_answered_is_logged_with_its_stack(client: openai.OpenAI, server: ServerProcess) -> None:
    """--log-error-stack: the error a 400 answers, with the traceback of where it was raised."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS + 2)
    log = server.log_path.read_text(errors="replace")
    logged = log[log.rindex("POST /v1/completions answered 400") :]
    assert "Traceback (most recent call last)" in logged and "BadRequestError" in logged, logged[:2000]


def test_logprobs_name_tokens_by_id_when_asked(client: openai.OpenAI, tokenizer: Any) -> None:
    extra = {**GREEDY["extra_body"], "return_token_ids": True, "return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2, extra_body=extra
    )
    (choice,) = chat.choices
    token_ids = choice.token_ids  # type: ignore[attr-defined]
    content = choice.logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{token}" for token in token_ids]
    # As vLLM's: the chosen token keeps its text's bytes, an alternative has its name's. A token that holds
    # the first bytes of a character has none, the one that ends it the character's; bytes that end no
    # character (the model's answer need not be valid UTF-8) are named by none.
    text = tokenizer.decode(token_ids)
    assert "\ufffd" in text
    assert b"".join(bytes(entry.bytes) for entry in content) == text.replace("\ufffd", "").encode()
    for entry, token in zip(content, token_ids, strict=True):
        assert entry.top_logprobs[0].token == f"token_id:{token}"  # greedy: the likeliest
        assert len(entry.top_logprobs) == 2
        assert all(top.bytes == list(top.token.encode()) for top in entry.top_logprobs)
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, temperature=0.0, extra_body=extra
    )
    (choice,) = completion.choices
    token_ids = choice.token_ids  # type: ignore[attr-defined]
    logprobs = choice.logprobs
    assert logprobs.tokens == [f"token_id:{token}" for token in token_ids]
    assert all(
        f"token_id:{token}" in top for token, top in zip(token_ids, logprobs.top_logprobs, strict=True)
    )
    # The offsets are still into the answer's text.
    lengths = [len(tokenizer.decode([token])) for token in token_ids]
    assert logprobs.text_offset == [sum(lengths[:index]) for index in range(len(lengths))]
    # Unasked, tokens go by their text.
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, **GREEDY)
    assert plain.choices[0].logprobs.tokens == [tokenizer.decode([token]) for token in token_ids]


def _model_logits(model_folder: Path, token_ids: list[int]) -> torch.Tensor:
    """Transformers' logits after each of the tokens: [len, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]


def _model_logprobs(model_folder: Path, token_ids: list[int]) -> torch.Tensor:
    """Transformers' log-softmax over the logits after each of the tokens: [len, vocab]."""
    return torch.log_softmax(_model_logits(model_folder, token_ids), dim=-1)


def _assert_vllm_prompt_logprobs(
    body: list[Any], token_ids: list[int], expected: torch.Tensor, top: int, tokenizer: Any
) -> None:
    """vLLM's prompt_logprobs: None first, then each token's logprob, rank and text by its id, beside the
    `top` likeliest, checked against the model's."""
    assert len(body) == len(token_ids) and body[0] is None
    for position, (token, entry) in enumerate(zip(token_ids[1:], body[1:], strict=True)):
        reference = expected[position]
        assert entry[str(token)]["logprob"] == pytest.approx(reference[token].item(), abs=1e-4)
        # A rank counts the tokens scored above: those within the tolerance may fall either side.
        above, near = reference > reference[token] + 1e-4, (reference - reference[token]).abs() <= 1e-4
        assert int(above.sum()) < entry[str(token)]["rank"] <= int(above.sum() + near.sum())
        assert all(scored["decoded_token"] == tokenizer.decode([int(key)]) for key, scored in entry.items())
        likeliest = sorted((scored["logprob"] for scored in entry.values()), reverse=True)[:top]
        np.testing.assert_allclose(likeliest, reference.topk(top).values.tolist(), atol=1e-4)


def test_prompt_logprobs_are_the_models_and_echo_carries_them(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path
) -> None:
    prompt_ids = tokenizer(PROMPT).input_ids
    expected = _model_logprobs(model_folder, prompt_ids)
    extra = {**GREEDY["extra_body"], "prompt_logprobs": 2, "return_token_ids": True}
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0.0, extra_body=extra
    )
    (choice,) = completion.choices
    _assert_vllm_prompt_logprobs(choice.prompt_logprobs, prompt_ids, expected, 2, tokenizer)  # type: ignore[attr-defined]
    # The echoed prompt's tokens lead the answer's logprobs, in OpenAI's shape.
    logprobs, answer_ids = choice.logprobs, choice.token_ids  # type: ignore[attr-defined]
    assert logprobs.tokens == [tokenizer.decode([token]) for token in prompt_ids + answer_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scored = [expected[position, token].item() for position, token in enumerate(prompt_ids[1:])]
    np.testing.assert_allclose(logprobs.token_logprobs[1 : len(prompt_ids)], scored, atol=1e-4)
    # Each token's top_logprobs name it first, then the likeliest token where that is another (OpenAI's
    # "logprobs + 1" at most); the answer is greedy, so its tokens are their likeliest.
    likeliest = [int(expected[position].argmax()) for position in range(len(prompt_ids) - 1)]
    likeliest += answer_ids
    named = [
        [tokenizer.decode([token])] + ([tokenizer.decode([best])] if best != token else [])
        for token, best in zip(prompt_ids[1:] + answer_ids, likeliest, strict=True)
    ]
    assert [list(top) for top in logprobs.top_logprobs[1:]] == named
    assert any(len(names) == 2 for names in named)
    assert len(logprobs.token_logprobs) == len(prompt_ids) + 3
    assert choice.text.startswith(PROMPT)
    # A chat request's rendered conversation, once for the response.
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, n=2, temperature=0.0, extra_body={"prompt_logprobs": 0}
    )
    rendered = _rendered(tokenizer)
    body = chat.prompt_logprobs  # type: ignore[attr-defined]
    _assert_vllm_prompt_logprobs(body, rendered, _model_logprobs(model_folder, rendered), 0, tokenizer)
    assert all(len(entry) == 1 for entry in body[1:])


_LOGPROB_FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _joined_choices(stream: Any) -> dict[int, dict[str, Any]]:
    """Each choice of a streamed completion, its text and logprobs joined across its chunks; and that no
    chunk carries prompt_logprobs."""
    joined: dict[int, dict[str, Any]] = {}
    for streamed in (choice for event in stream for choice in event.choices):
        assert "prompt_logprobs" not in (streamed.model_extra or {})
        entry = joined.setdefault(streamed.index, {"text": "", **{name: [] for name in _LOGPROB_FIELDS}})
        entry["text"] += streamed.text
        for name in _LOGPROB_FIELDS if streamed.logprobs is not None else ():
            entry[name] += getattr(streamed.logprobs, name)
    return joined


def test_a_streamed_echo_leads_with_its_prompts_logprobs_as_the_answer_does(client: openai.OpenAI) -> None:
    """As vLLM streams it: each choice's first chunk holds its prompt and the prompt tokens' logprobs before
    its first token's. Joined, each streamed choice is the unstreamed one (whose logprobs are checked against
    Transformers above), offsets too, though the text sent may hold a token's back (the start of a character
    the next token ends). prompt_logprobs 0, which vLLM takes with stream, is taken and sends nothing."""
    prompts = [PROMPT, "The fox"]
    asked: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompts,
        "max_tokens": 4,
        "logprobs": 2,
        "echo": True,
        "n": 2,
        "temperature": 0.0,
    }
    whole = client.completions.create(**asked, extra_body=GREEDY["extra_body"])
    stream = client.completions.create(
        **asked, stream=True, extra_body={**GREEDY["extra_body"], "prompt_logprobs": 0}
    )
    joined = _joined_choices(stream)
    assert sorted(joined) == [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    for choice in whole.choices:
        streamed, answered = joined[choice.index], choice.logprobs
        assert streamed["text"] == choice.text
        assert streamed["tokens"] == answered.tokens and streamed["text_offset"] == answered.text_offset
        assert streamed["token_logprobs"][0] is None and streamed["top_logprobs"][0] is None
        assert streamed["token_logprobs"][1:] == pytest.approx(answered.token_logprobs[1:], abs=1e-5)
        for got, want in zip(streamed["top_logprobs"][1:], answered.top_logprobs[1:], strict=True):
            assert got == pytest.approx(want, abs=1e-5)
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
    )
    assert all("prompt_logprobs" not in (event.model_extra or {}) for event in chat)


def test_logprobs_name_each_character_once_and_offsets_count_the_names(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    """As vLLM's: a token that holds the first bytes of a character is named "" and the token that ends it
    the whole character, so the names of an echoed prompt and its answer join to the prompt's tokens'
    decoding and then the answer; each offset counts the names before it (the beginning-of-text token's
    too, which the echo leaves out). An echo with logprobs answers the prompt's logprobs too, as vLLM's."""
    prompt = "日本語 😀 café"
    prompt_ids = tokenizer(prompt).input_ids
    asked: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "logprobs": 1, "echo": True}
    (choice,) = client.completions.create(**asked, **GREEDY).choices
    logprobs = choice.logprobs
    named_prompt = "".join(logprobs.tokens[: len(prompt_ids)])
    assert named_prompt == tokenizer.decode(prompt_ids) and named_prompt.endswith(prompt)
    assert "" in logprobs.tokens[: len(prompt_ids)] and "😀" in logprobs.tokens
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:at])) for at in range(len(logprobs.tokens))]
    assert choice.text.startswith(prompt)
    scored = choice.prompt_logprobs  # type: ignore[attr-defined]
    assert scored[0] is None and len(scored) == len(prompt_ids)
    for token, logprob, entry in zip(prompt_ids[1:], logprobs.token_logprobs[1:], scored[1:], strict=False):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob)
    (streamed,) = _joined_choices(client.completions.create(**asked, stream=True, **GREEDY)).values()
    assert (streamed["tokens"], streamed["text_offset"]) == (logprobs.tokens, logprobs.text_offset)


def test_a_chat_echo_begins_the_answer_with_the_last_message_in_its_role(client: openai.OpenAI) -> None:
    """vLLM's chat echo: an answer that goes on with the last message (add_generation_prompt false) begins
    with that message's text, in its own chunk when streamed; an answer in another role than the last
    message's echoes nothing."""
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Once"}]
    going_on: dict[str, Any] = {"add_generation_prompt": False, "continue_final_message": True}
    asked: dict[str, Any] = {"model": "tiny", "messages": prefilled, "max_tokens": 4, "temperature": 0.0}
    plain = client.chat.completions.create(**asked, extra_body=going_on).choices[0].message.content
    echoed = client.chat.completions.create(**asked, extra_body={**going_on, "echo": True})
    assert echoed.choices[0].message.content == "Once" + plain
    stream = client.chat.completions.create(**asked, stream=True, extra_body={**going_on, "echo": True})
    deltas = [choice.delta for event in stream for choice in event.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == "Once"
    assert "".join(delta.content or "" for delta in deltas) == "Once" + plain
    fresh: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0}
    answer = client.chat.completions.create(**fresh).choices[0].message.content
    assert (
        client.chat.completions.create(**fresh, extra_body={"echo": True}).choices[0].message.content
        == answer
    )


def test_an_echo_of_max_tokens_0_answers_the_prompt_alone(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path, server: ServerProcess
) -> None:
    """OpenAI's and vLLM's way to score a prompt: echo with max_tokens 0 answers the prompt and its tokens'
    logprobs (the model's), streamed or not, and no token of its own (usage counts the one the engine ran
    it for, as vLLM's does). Without echo, max_tokens 0 asks for nothing, and is refused."""
    prompt_ids = tokenizer(PROMPT).input_ids
    expected = _model_logprobs(model_folder, prompt_ids)
    scored = [expected[position, token].item() for position, token in enumerate(prompt_ids[1:])]
    asked: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    (choice,) = client.completions.create(**asked, extra_body={"return_token_ids": True}).choices
    assert (choice.text, choice.token_ids, choice.finish_reason) == (PROMPT, [], "length")  # type: ignore[attr-defined]
    assert choice.logprobs.tokens == [tokenizer.decode([token]) for token in prompt_ids]
    assert choice.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], scored, atol=1e-4)
    (streamed,) = _joined_choices(client.completions.create(**asked, stream=True)).values()
    assert streamed["text"] == PROMPT and streamed["tokens"] == choice.logprobs.tokens
    np.testing.assert_allclose(streamed["token_logprobs"][1:], scored, atol=1e-4)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"


def _processed_logprobs(model_folder: Path, prompt_ids: list[int], answer_ids: list[int]) -> torch.Tensor:
    """[len(answer_ids), vocab]: the log-softmax of each answer token's distribution after SAMPLED's
    temperature and top_k, by Transformers' logits and warpers (-inf where top_k rules a token out)."""
    logits = _model_logits(model_folder, prompt_ids + answer_ids[:-1])[len(prompt_ids) - 1 :]
    warpers = [
        TemperatureLogitsWarper(SAMPLED["temperature"]),
        TopKLogitsWarper(SAMPLED["extra_body"]["top_k"]),
    ]
    for warper in warpers:
        logits = warper(torch.tensor([prompt_ids + answer_ids]), logits)
    return torch.log_softmax(logits, dim=-1)


def _assert_top_two_and_ruled_out(answered: list[float], expected: torch.Tensor) -> None:
    """MAX_LOGPROBS alternatives: the two top_k keeps, as expected, then one it rules out."""
    best_first = sorted(answered, reverse=True)
    assert best_first[:2] == pytest.approx(expected.topk(2).values.tolist(), abs=1e-4)
    assert best_first[2:] == [-9999.0]


def test_processed_logprobs_are_of_the_distribution_sampled_from(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path
) -> None:
    """The server runs with vLLM's logprobs-mode processed_logprobs (in its config file): a sampled token's
    logprobs are those it was drawn from, and a token its top_k rules out scores -9999.0, streamed or not.
    (Its prompt logprobs, above, are the model's all the same.)"""
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=MAX_LOGPROBS, **SAMPLED
    )
    (choice,) = chat.choices
    answer_ids = choice.token_ids  # type: ignore[attr-defined]
    expected = _processed_logprobs(model_folder, _rendered(tokenizer), answer_ids)
    for position, (token, entry) in enumerate(zip(answer_ids, choice.logprobs.content, strict=True)):
        assert entry.logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
        _assert_top_two_and_ruled_out([top.logprob for top in entry.top_logprobs], expected[position])
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, logprobs=MAX_LOGPROBS, stream=True, **SAMPLED
    )
    answer_ids, token_logprobs, tops = [], [], []
    # The server's usage closes the stream with a chunk of no choice.
    for streamed in (choice for event in stream for choice in event.choices):
        answer_ids += streamed.token_ids  # type: ignore[attr-defined]
        token_logprobs += streamed.logprobs.token_logprobs
        tops += streamed.logprobs.top_logprobs
    expected = _processed_logprobs(model_folder, tokenizer(PROMPT).input_ids, answer_ids)
    assert len(answer_ids) == len(token_logprobs) == 5
    for position, (token, logprob, top) in enumerate(zip(answer_ids, token_logprobs, tops, strict=True)):
        assert logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
        _assert_top_two_and_ruled_out(list(top.values()), expected[position])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
    ],
)
def test_prompt_logprobs_it_cannot_answer_are_refused_by_name(
    server: ServerProcess, fields: dict[str, Any], named: str
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **fields}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == named


def test_responses_and_embeddings_answer_the_sdks_calls(
    client: openai.OpenAI, tokenizer: Any, model_folder: Path
) -> None:
    greedy: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "max_output_tokens": 5}
    response = client.responses.create(input=PROMPT, **greedy)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], temperature=0.0, max_tokens=5
    )
    assert response.output_text == chat.choices[0].message.content
    with client.responses.stream(input=PROMPT, **greedy) as stream:
        assert stream.get_final_response().output_text == response.output_text
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    }
    tool: Any = {"type": "function", "name": "get_weather", "parameters": city}
    called = client.responses.create(
        **{**greedy, "max_output_tokens": 200}, input=PROMPT, tools=[tool], tool_choice="required"
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(json.loads(call.arguments).keys() == {"city"} for call in calls)
    # Kept by the store vLLM's environment switch turns on; the follow-up's prompt holds the first turn (this
    # module's template renders contents only, not calls).
    results: Any = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls
    ]
    follow_up = client.responses.create(input=results, previous_response_id=called.id, **greedy)
    assert follow_up.previous_response_id == called.id
    assert follow_up.usage.input_tokens > called.usage.input_tokens
    embedding = client.embeddings.create(model="tiny", input=PROMPT).data[0].embedding
    model = AutoModel.from_pretrained(model_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        last = model(torch.tensor([tokenizer(PROMPT).input_ids])).last_hidden_state[0, -1]
    np.testing.assert_allclose(embedding, torch.nn.functional.normalize(last, dim=0).numpy(), atol=1e-4)


def test_version_and_ping_with_and_without_the_root_path(server: ServerProcess) -> None:
    for prefix in ("", ROOT_PATH):
        assert httpx.get(f"{server.url}{prefix}/version", timeout=10).json() == {
            "version": version("kvfleet")
        }
        assert httpx.get(f"{server.url}{prefix}/ping", timeout=10).status_code == 200
        assert httpx.post(f"{server.url}{prefix}/ping", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}{prefix}/v1/models", timeout=10).status_code == 200


def test_cors_preflight_answers_the_allowed_origin_only(server: ServerProcess) -> None:
    def preflight(origin: str) -> httpx.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        return httpx.options(f"{server.url}/v1/chat/completions", headers=headers, timeout=10)

    allowed = preflight(ALLOWED_ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = preflight("https://elsewhere.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


UNKNOWN_ARCHITECTURE = {"architectures": ["GPT2LMHeadModel"]}


@pytest.mark.parametrize(
    ("model", "options", "words"),
    [
        ("missing", (), "does not exist"),
        ("empty", (), "holds no config.json"),
        ("unknown", (), "'GPT2LMHeadModel' is not supported"),
        ("tiny", ("--hf-overrides", json.dumps(UNKNOWN_ARCHITECTURE)), "with hf_overrides: model architec"),
    ],
)
def test_a_bad_model_path_fails_in_one_line_before_listening(
    model: str, options: tuple[str, ...], words: str, tmp_path: Path, tiny_llama: Path
) -> None:
    (tmp_path / "empty").mkdir()
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_llama, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, **UNKNOWN_ARCHITECTURE}))
    path = str(tiny_llama if model == "tiny" else tmp_path / model)
    port = free_port()
    start = time.monotonic()
    completed = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "kvfleet",
            "serve",
            path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert time.monotonic() - start < 5
    assert completed.returncode != 0
    lines = [line for line in (completed.stdout + completed.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_hf_overrides_must_be_a_json_object(tiny_llama: Path) -> None:
    completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), "--hf-overrides", "[1]"])
    assert completed.exit_code == 2
    assert "--hf-overrides" in completed.output and "must be a JSON object" in completed.output


@pytest.mark.parametrize(
    ("content", "name", "words"),
    [
        ("max-num-seq: 4\n", "serve.yaml", "'max-num-seq' is not an option of this command"),
        ("- 4\n", "serve.yaml", "must map option names to values"),
        ("port: 8000\n", "serve.json", "a config file is YAML"),
    ],
)
def test_a_config_file_it_cannot_read_is_refused(
    tiny_llama: Path, tmp_path: Path, content: str, name: str, words: str
) -> None:
    config = tmp_path / name
    config.write_text(content)
    completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), "--config", str(config)])
    assert completed.exit_code == 2
    assert "--config" in completed.output and words in completed.output


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
        (["--reasoning-parser", "qwen3"], "--reasoning-parser"),
        (["--reasoning-parser", "granite"], "reasoning_parser 'granite' is not one of"),
        (["--structured-outputs-config", '{"backend": "outlines"}'], "structured_outputs_config.backend"),
        # vLLM's flags kvfleet lacks: refused with the reason, not as unknown options.
        (["--async-scheduling"], "--async-scheduling is vLLM's and not kvfleet's: kvfleet's engine core"),
        (["--data-parallel-size", "2"], "--data-parallel-size is vLLM's and not kvfleet's: a kvfleet"),
        (["-O3"], "-O is vLLM's and not kvfleet's: the model runs eagerly"),
        (["--prefix-caching-hash-algo", "sha256_cbor"], "--prefix-caching-hash-algo is vLLM's and not"),
        (["--headless"], "--headless is vLLM's and not kvfleet's: a node other than the first"),
        (
            ["--lora-dtype", "bfloat16"],
            "--lora-dtype is vLLM's and not kvfleet's: adapters run in the model's",
        ),
        (["--model-impl", "transformers"], "--model-impl"),
        (["--structured-outputs-config", '{"enable_in_reasoning": true}'], "enable_in_reasoning"),
        # The config's parser is checked as the flag's: the tiny model's tokenizer has no reasoning tags.
        (["--structured-outputs-config", '{"reasoning_parser": "qwen3"}'], "--reasoning-parser"),
        (["--max-logprobs", "21"], "--max-logprobs"),
        (["--allowed-origins", "https://app.example"], "--allowed-origins"),
        (["--stream-interval", "0"], "stream_interval"),
        (["--long-prefill-token-threshold", "-1"], "long_prefill_token_threshold"),
        (["--load-format", "pt"], "--load-format"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode"),
        (["--enable-log-outputs"], "--enable-log-outputs"),
        (["--disable-access-log-for-endpoints", "/health,metrics"], "--disable-access-log-for-endpoints"),
    ],
)
def test_flags_it_cannot_honour_are_refused_by_name(tiny_llama: Path, flags: list[str], named: str) -> None:
    completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), *flags])
    assert completed.exit_code == 2
    assert named in completed.output.splitlines()[-1]


@pytest.mark.parametrize(
    "command", [["serve"], ["run-batch"], ["bench", "serve"], ["make-model"], ["operator"]]
)
def test_log_level_is_taken_after_any_subcommand(command: list[str]) -> None:
    completed = CliRunner().invoke(cli, [*command, "--log-level", "debug", "--help"])
    assert completed.exit_code == 0, completed.output
    assert "--log-level" in completed.output


def test_an_adapter_may_not_take_any_of_the_models_names(tiny_llama: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", rank=8, seed=1)
    served = ["--served-model-name", "tiny", "tiny-alias", "--enable-lora"]
    completed = CliRunner().invoke(
        cli, ["serve", str(tiny_llama), *served, "--lora-modules", f"tiny-alias={adapter}"]
    )
    assert completed.exit_code == 2
    assert "'tiny-alias' is already in use" in completed.output.splitlines()[-1]


def test_another_folders_generation_config_also_bounds_what_requests_ask(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    other = start_server("--generation-config", str(tmp_path))
    client = openai.OpenAI(base_url=f"{other.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for max_tokens in (None, 3, 10):
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == min(max_tokens or 4, 4)
    # The completions route's own default (16 tokens) is bounded too.
    completion = client.completions.create(model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4


def test_server_defaults_for_sampling_templates_and_roles(
    start_server: Callable[..., ServerProcess], tmp_path: Path, tokenizer: Any
) -> None:
    """--override-generation-config over vLLM's own defaults, --default-chat-template-kwargs under a
    request's, --response-role for answers the generation prompt opens (others go on in the last message's
    role), --enable-log-requests with --enable-log-outputs, --return-tokens-as-token-ids and
    --exclude-tools-when-tool-choice-none, each as vLLM's server takes them; the fleet gateway renders chat
    prompts with the template settings the server's tokenizer answer gives."""
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    other = start_server(
        "--generation-config", "vllm", "--override-generation-config", '{"max_new_tokens": 5}',
        "--default-chat-template-kwargs", '{"enable_thinking": false}', "--response-role", "narrator",
        "--chat-template", str(template),
        "--enable-log-requests", "--max-log-len", "3", "--log-level", "debug", "--return-tokens-as-token-ids",
        "--exclude-tools-when-tool-choice-none", "--enable-log-outputs",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{other.url}/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"ignore_eos": True, "return_token_ids": True}
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=extra)
    assert chat.usage.completion_tokens == 5
    assert chat.choices[0].message.role == "narrator"  # type: ignore[comparison-overlap]

    assert chat.prompt_token_ids == _rendered(tokenizer, enable_thinking=False)  # type: ignore[attr-defined]
    assert httpx.get(f"{other.url}/tokenizer_info", timeout=30).status_code == 404  # not asked for
    log = other.log_path.read_text()
    assert f"Received request {chat.id}: params: SamplingParams(" in log
    assert f"Request {chat.id} prompt_token_ids: [{_rendered(tokenizer, enable_thinking=False)[:3]}]" in log
    # What it generated, cut to --max-log-len: its text at INFO, its token ids at DEBUG.
    text, answer_ids = chat.choices[0].message.content or "", chat.choices[0].token_ids  # type: ignore[attr-defined]
    logged = f"Generated response {chat.id}-0 choice 0: output: {text[:3]!r}, finish_reason: length"
    assert logged in log
    assert f"Generated response {chat.id}-0 choice 0: output_token_ids: {answer_ids[:3]}" in log
    streamed = list(
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, stream=True, extra_body=extra)
    )
    stream_id = streamed[0].id
    deltas = [event.choices[0] for event in streamed if event.choices and event.choices[0].token_ids]  # type: ignore[attr-defined]
    log = other.log_path.read_text()
    assert log.count(f"Generated response {stream_id}-0 choice 0 (delta): output: ") == len(deltas) >= 1
    whole = "".join(delta.text for delta in deltas)
    completed = f"Generated response {stream_id}-0 choice 0 (stream complete): output: {whole[:3]!r}"
    assert f"{completed}, finish_reason: length" in log
    thinking = {**extra, "chat_template_kwargs": {"enable_thinking": True}}
    asked = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=thinking)
    assert asked.prompt_token_ids == _rendered(tokenizer)  # type: ignore[attr-defined]
    first = next(
        iter(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, stream=True))
    )
    assert first.choices[0].delta.role == "narrator"  # type: ignore[comparison-overlap]
    going_on = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert going_on.choices[0].message.role == "user"  # type: ignore[comparison-overlap]
    # --exclude-tools-when-tool-choice-none: tools a request may not call are left out of its prompt.
    tools: Any = {"tools": [WEATHER_TOOL], "max_tokens": 1, "extra_body": {"return_token_ids": True}}
    excluded = client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="none", **tools)
    assert excluded.prompt_token_ids == _rendered(tokenizer, enable_thinking=False)  # type: ignore[attr-defined]
    named = {"type": "function", "function": {"name": "get_weather"}}
    listed = client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice=named, **tools)
    expected = _rendered(tokenizer, tools=[WEATHER_TOOL], enable_thinking=False)
    gateway = _gateway_prompts(other.url)
    for prompt_ids, body in [
        (chat.prompt_token_ids, {"messages": MESSAGES}),  # type: ignore[attr-defined]
        (asked.prompt_token_ids, {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}),  # type: ignore[attr-defined]
        (excluded.prompt_token_ids, {"messages": MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "none"}),  # type: ignore[attr-defined]
    ]:
        blocks = gateway.blocks(CHAT_PATH, {"model": "tiny", **body})
        assert blocks is not None and blocks.token_ids == prompt_ids
    assert listed.prompt_token_ids == expected  # type: ignore[attr-defined]
    # --return-tokens-as-token-ids names logprobs' tokens by id, unless a request says otherwise.
    for asked, by_id in ((None, True), (False, False)):
        body = {"return_token_ids": True, "return_tokens_as_token_ids": asked}
        completion = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, logprobs=1, extra_body=body
        )
        token_ids = completion.choices[0].token_ids  # type: ignore[attr-defined]
        names = [f"token_id:{t}" if by_id else tokenizer.decode([t]) for t in token_ids]
        assert completion.choices[0].logprobs.tokens == names


def test_a_unix_socket_server_whose_access_log_leaves_out_the_probes(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """--uds serves on a Unix domain socket instead of --host and --port (a stale socket file replaced), and
    --disable-access-log-for-endpoints keeps the probes' paths out of the access log, whatever their query."""
    path = tmp_path / "kvfleet.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    server = start_server(
        "--uds",
        str(path),
        "--access-log",
        "--disable-access-log-for-endpoints",
        "/health, /metrics",
        wait=False,
    )
    with httpx.Client(
        transport=httpx.HTTPTransport(uds=str(path)), base_url="http://kvfleet", timeout=60
    ) as client:
        deadline = time.monotonic() + 180
        while not _answers(client, "/ready"):
            assert server.process.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        for probe in ("/health", "/metrics", "/health?probe=1"):
            assert client.get(probe).status_code == 200
        assert client.get("/v1/models").status_code == 200
        answer = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)  # --host and --port are not served
    log = server.log_path.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in log and '"POST /v1/completions HTTP/1.1" 200' in log
    assert "GET /health" not in log and "GET /metrics" not in log


def _answers(client: httpx.Client, path: str) -> bool:
    try:
        return client.get(path).status_code == 200
    except httpx.TransportError:
        return False


# vLLM's switches of the server that it also takes negated (its argparse BooleanOptionalAction).
NEGATABLE_SWITCHES = (
    "allow-credentials",
    "disable-cascade-attn",
    "disable-custom-all-reduce",
    "disable-fastapi-docs",
    "disable-uvicorn-access-log",
    "enable-auto-tool-choice",
    "enable-force-include-usage",
    "enable-log-outputs",
    "enable-log-requests",
    "enable-prompt-tokens-details",
    "enable-request-id-headers",
    "enable-server-load-tracking",
    "enable-ssl-refresh",
    "enable-tokenizer-info-endpoint",
    "enforce-eager",
    "exclude-tools-when-tool-choice-none",
    "log-error-stack",
    "return-tokens-as-token-ids",
    "trust-remote-code",
    "trust-request-chat-template",
)


def test_vllms_switches_are_taken_negated_too(tiny_llama: Path) -> None:
    serve = cli.get_command(click.Context(cli), "serve")
    for switch in NEGATABLE_SWITCHES:
        name = switch.replace("-", "_")
        assert serve.make_context("serve", [str(tiny_llama), f"--{switch}"]).params[name] is True, switch
        assert serve.make_context("serve", [str(tiny_llama), f"--no-{switch}"]).params[name] is False, switch
        assert serve.make_context("serve", [str(tiny_llama)]).params[name] is False, switch


def test_vllms_integers_with_units_and_its_second_flag_names_are_taken(tiny_llama: Path) -> None:
    """vLLM's forms (its human_readable_int's documented examples): k and the like in powers of 1,000, K in
    powers of 1,024, auto or -1 for the longest context that fits; --device-memory-utilization as
    --gpu-memory-utilization."""
    serve = cli.get_command(click.Context(cli), "serve")
    flags = ["--max-model-len", "25.6k", "--max-num-batched-tokens", "1K", "--kv-cache-memory-bytes", "2M"]
    flags += ["--max-num-queued-tokens", "1k", "--device-memory-utilization", "0.5"]
    options = serve.make_context("serve", [str(tiny_llama), *flags]).params
    taken = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes", "max_num_queued_tokens")
    assert [options[name] for name in taken] == [25_600, 1024, 2 * 1024**2, 1000]
    assert options["gpu_memory_utilization"] == 0.5
    for auto in ("auto", "-1"):
        assert (
            serve.make_context("serve", [str(tiny_llama), "--max-model-len", auto]).params["max_model_len"]
            == -1
        )
    for bad, words in (("2.5K", "a binary unit (K) takes a whole number"), ("lots", "is not an integer")):
        completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), "--max-model-len", bad])
        assert (
            completed.exit_code == 2 and "--max-model-len" in completed.output and words in completed.output
        )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--override-generation-config", '{"max_length": 5}'], "'max_length' is not one of"),
        (["--override-generation-config", '{"temperature": -1}'], "temperature must be non-negative"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
        (
            ["--default-chat-template-kwargs", '{"tokenize": false}'],
            "'tokenize' is a parameter of the rendering",
        ),
    ],
)
def test_bad_server_defaults_are_refused_by_name(tiny_llama: Path, flags: list[str], words: str) -> None:
    completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), *flags])
    assert completed.exit_code == 2
    assert flags[0] in completed.output and words in completed.output
