"""A vLLM user's command line and clients, unchanged: `kvfleet serve` started the way vLLM's docs start
`vllm serve` (positional model, list forms, vLLM's flags, --log-level after the subcommand), called with the
official openai SDK for vLLM's API extensions (return_token_ids, stop_reason, chat_template_kwargs), the
Responses API and embeddings, checked against the model folder's own tokenizer, Transformers' rendering of
the chat template and Transformers' hidden states."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from click.testing import CliRunner
from kvfleet.runtime.lora.make_adapter import make_adapter
from ports import free_port
from servers import ServerProcess
from transformers import AutoModel, AutoTokenizer

from kvfleet.cli import cli

ALLOWED_ORIGIN = "https://app.example"
ROOT_PATH = "/llm"
# What the model folder's generation_config.json recommends, beside its token ids.
GENERATION_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 6}
MAX_LOGPROBS = 3
# Qwen3's thinking switch, in a template of its own: the template, not the server, reads the variable.
CHAT_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}:\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPT = "Once upon a time"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


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
    command += ["--served-model-name", "tiny", "tiny-alias"]
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
    command += ["--dtype", "float32", "--num-kv-blocks", "512", "--host", "127.0.0.1", "--port", str(port)]
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

    def rendered(**template_kwargs: Any) -> list[int]:
        return tokenizer.apply_chat_template(
            MESSAGES,
            chat_template=CHAT_TEMPLATE,
            add_generation_prompt=True,
            tokenize=True,
            **template_kwargs,
        )["input_ids"]

    without_thinking = prompt_ids({"enable_thinking": False})
    assert without_thinking == rendered(enable_thinking=False)
    assert prompt_ids({"enable_thinking": True}) == prompt_ids(None) == rendered()
    assert without_thinking != rendered()
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"] == without_thinking
    with pytest.raises(openai.BadRequestError) as caught:
        prompt_ids({"tokenize": False})
    assert caught.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


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


def test_max_logprobs_bounds_what_requests_ask(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS)
    assert all(len(top) == MAX_LOGPROBS for top in completion.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    assert caught.value.body["param"] == "logprobs"  # type: ignore[index]


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


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("missing", "does not exist"),
        ("empty", "holds no config.json"),
        ("unknown", "'GPT2LMHeadModel' is not supported"),
    ],
)
def test_a_bad_model_path_fails_in_one_line_before_listening(
    model: str, words: str, tmp_path: Path, tiny_llama: Path
) -> None:
    (tmp_path / "empty").mkdir()
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_llama, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    path = str(tmp_path / model)
    port = free_port()
    start = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-P", "-m", "kvfleet", "serve", path, "--host", "127.0.0.1", "--port", str(port)],
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


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
        (["--reasoning-parser", "qwen3"], "--reasoning-parser"),
        (["--reasoning-parser", "granite"], "--reasoning-parser"),
        (["--max-logprobs", "21"], "--max-logprobs"),
        (["--allowed-origins", "https://app.example"], "--allowed-origins"),
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
