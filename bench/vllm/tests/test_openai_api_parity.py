"""kvfleet's OpenAI server against vLLM's own (its CPU build), both serving the same folder: the same requests
get the same answers, field for field, streamed or not.

The cases are the ones where the two shape an answer from the same tokens: logprobs in the legacy and chat
shapes (the chosen token first in a completion's top_logprobs, names of tokens that hold part of a character,
offsets), echo with and without logprobs (a chat's too), prompt_logprobs, token ids, stop strings, prompts cut
by truncate_prompt_tokens, the model's other end-of-sequence token, usage in every chunk, constrained outputs,
Anthropic's Messages API (its blocks, stop sequences and events, and its counts). Greedy answers, so that both
choose the same tokens. Where vLLM sends a field as null, kvfleet may leave it out; where vLLM leaves one out,
so must kvfleet.

Two differences are kept, and checked as such: an answer cut within a character (its last tokens hold the
first bytes of one) ends in U+FFFD in kvfleet's text, as the tokenizer decodes those tokens, where vLLM's
text leaves them out; and a chat's echo scores the prompt in vLLM's server whether or not prompt_logprobs
asks, in kvfleet's only when asked.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.vllm.kv_events import free_port, process_group, wait_for

VLLM_COMMAND = Path(__file__).with_name("vllm_command.py")
MODEL = "small"
# The fields each answer's own: ids, times, and vLLM's build.
OWN_FIELDS = {"id", "created", "system_fingerprint"}
# Logprobs, as two implementations add them up in float32.
TOLERANCE = 1e-3
PROMPT = "Once upon a time"
LONGER = PROMPT + " there was"
CJK = "日本語のテキスト 😀 café"
CHAT = [{"role": "user", "content": "Hi there"}]
GOING_ON = {"add_generation_prompt": False, "continue_final_message": True}
SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "boolean"}, "n": {"type": "string", "maxLength": 5}},
    "required": ["b", "n"],
}
CHAT_ECHO = {
    "messages": [*CHAT, {"role": "assistant", "content": "Well"}],
    "max_tokens": 4,
    "echo": True,
    **GOING_ON,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "logprobs": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2}),
    "logprobs 0": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 0}),
    "echo": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True}),
    "echo with logprobs": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "echo": True},
    ),
    "echo with more prompt logprobs": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "echo": True, "prompt_logprobs": 3},
    ),
    "echo of the prompt alone": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1, "echo": True},
    ),
    "prompt logprobs": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 2}),
    "token ids": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True}),
    "token prompt": ("/v1/completions", {"prompt": [621, 341, 1193], "max_tokens": 4}),
    "two prompts": ("/v1/completions", {"prompt": [PROMPT, "Hello"], "max_tokens": 4, "logprobs": 1}),
    "stop string": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop": ["claims"]}),
    "stop string kept": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "stop": ["claims"], "include_stop_str_in_output": True},
    ),
    "characters in parts": (
        "/v1/completions",
        {"prompt": CJK, "max_tokens": 12, "logprobs": 2, "echo": True},
    ),
    "characters in parts, prompt logprobs": (
        "/v1/completions",
        {"prompt": CJK, "max_tokens": 2, "prompt_logprobs": 3},
    ),
    "long": ("/v1/completions", {"prompt": "The", "max_tokens": 60, "logprobs": 3}),
    "streamed echo with logprobs": (
        "/v1/completions",
        {"prompt": CJK, "max_tokens": 6, "logprobs": 1, "echo": True, "stream": True},
    ),
    "chat logprobs": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    ),
    "chat characters in parts": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "日本語 😀"}],
            "max_tokens": 16,
            "logprobs": True,
            "top_logprobs": 3,
        },
    ),
    "chat streamed": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat echo scoring its prompt": ("/v1/chat/completions", {**CHAT_ECHO, "prompt_logprobs": 0}),
    "chat echo streamed": ("/v1/chat/completions", {**CHAT_ECHO, "stream": True}),
    "a text cut": ("/v1/completions", {"prompt": LONGER, "max_tokens": 3, "truncate_prompt_tokens": 3}),
    "a text cut on the left": (
        "/v1/completions",
        {"prompt": LONGER, "max_tokens": 2, "truncate_prompt_tokens": 3, "truncation_side": "left"},
    ),
    "a text cut on the right": (
        "/v1/completions",
        {"prompt": LONGER, "max_tokens": 3, "truncate_prompt_tokens": 3, "truncation_side": "right"},
    ),
    "a text cut to its context": (
        "/v1/completions",
        {"prompt": LONGER, "max_tokens": 3, "truncate_prompt_tokens": -1},
    ),
    "tokens cut": (
        "/v1/completions",
        {"prompt": [0, 621, 341, 1193, 292, 262, 422], "max_tokens": 4, "truncate_prompt_tokens": 3},
    ),
    "a chat cut": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "truncate_prompt_tokens": 5}),
    "the other end token": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 5, "logit_bias": {"1": 100}, "return_token_ids": True},
    ),
    "a choice": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}},
    ),
    "a regex": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 20, "structured_outputs": {"regex": "[a-c]{3}"}},
    ),
    "a JSON schema": (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 30,
            "structured_outputs": {
                "json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            },
        },
    ),
    "a JSON object": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 20, "response_format": {"type": "json_object"}},
    ),
    "a response format": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        },
    ),
    "a grammar": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 20, "structured_outputs": {"grammar": 'root ::= "a" [b-d]+ "e"'}},
    ),
    "usage in every chunk": (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "usage in every chat chunk": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "a message": ("/v1/messages", {"messages": CHAT, "max_tokens": 8}),
    "a message with a system prompt": (
        "/v1/messages",
        {"system": [{"type": "text", "text": "Be brief."}], "messages": CHAT, "max_tokens": 8},
    ),
    "a message stopped by a sequence": (
        "/v1/messages",
        {"messages": CHAT, "max_tokens": 16, "stop_sequences": ["a", "e"]},
    ),
    "a message of three blocks": (
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in "abc"]}],
            "max_tokens": 4,
        },
    ),
    "a message in JSON": (
        "/v1/messages",
        {
            "messages": CHAT,
            "max_tokens": 20,
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
    ),
    "a streamed message": ("/v1/messages", {"messages": CHAT, "max_tokens": 4, "stream": True}),
    "tokens of a message counted": ("/v1/messages/count_tokens", {"system": "Be brief.", "messages": CHAT}),
    "tokenize": ("/tokenize", {"prompt": PROMPT}),
    "tokenize, with the pieces": ("/tokenize", {"prompt": CJK, "return_token_strs": True}),
    "tokenize a chat": ("/tokenize", {"messages": CHAT}),
    "detokenize": ("/detokenize", {"tokens": [621, 341, 1193]}),
}


# The same, of both servers pooling the model's hidden states into embeddings (--runner pooling). Embeddings
# in float form: base64's bytes differ in the last bits of the floats.
POOLING_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "an embedding": ("/v1/embeddings", {"input": PROMPT}),
    "embeddings of two texts": ("/v1/embeddings", {"input": [PROMPT, "Hello"]}),
    "an embedding of tokens": ("/v1/embeddings", {"input": [621, 341, 1193]}),
    "an embedding of a chat": ("/v1/embeddings", {"messages": CHAT}),
    "an embedding not normalized": ("/v1/embeddings", {"input": PROMPT, "use_activation": False}),
    "an embedding of a text cut": ("/v1/embeddings", {"input": LONGER, "truncate_prompt_tokens": 3}),
    "an embedding of a text cut on the left": (
        "/v1/embeddings",
        {"input": LONGER, "truncate_prompt_tokens": 3, "truncation_side": "left"},
    ),
    "pooling": ("/pooling", {"input": PROMPT}),
    "a score of one against two": ("/score", {"text_1": PROMPT, "text_2": ["Hello", "The fox"]}),
    "scores pair by pair": ("/score", {"text_1": [PROMPT, "Hi"], "text_2": ["Hello", "The fox"]}),
    "a rerank": ("/rerank", {"query": PROMPT, "documents": ["Hello", "The fox", "Once more"]}),
}


@contextmanager
def _both_serving(model: Path, logs: Path, ipc: Path, *flags: str) -> Iterator[dict[str, str]]:
    """vLLM's server and kvfleet's on the same folder with the same flags, by name: their base URLs."""
    python = os.environ.get("VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.fail("set VLLM_PYTHON to the python of vLLM's environment (make test-vllm-runtime does)")
    serving = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024", *flags]
    commands = {
        "vllm": [python, "-P", str(VLLM_COMMAND), "serve", str(model), *serving],
        "kvfleet": [str(Path(sys.executable).parent / "kvfleet"), "serve", str(model), *serving],
    }
    # vLLM's CPU build takes a share of the machine's memory unless told its KV cache's size (GiB); its
    # processes talk over sockets in a folder whose path must be short.
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(ipc)}
    with ExitStack() as stack:
        urls = {}
        for name, command in commands.items():
            port = free_port()
            command = [*command, "--host", "127.0.0.1", "--port", str(port)]
            env = vllm_env if name == "vllm" else None
            # Outside the repository, whose operator/ would stand for the standard library's module in the
            # subprocess vLLM inspects a model's architecture in.
            process = stack.enter_context(process_group(command, logs / f"{name}.log", env, cwd=logs))
            url = f"http://127.0.0.1:{port}"
            wait_for(name, lambda url=url: httpx.get(f"{url}/health").status_code == 200, 600, process)
            urls[name] = url
        yield urls


@pytest.fixture(scope="module")
def servers(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs, ipc = tmp_path_factory.mktemp("parity-logs"), tmp_path_factory.mktemp("ipc")
    # JSON without whitespace, as kvfleet always writes it.
    outputs = [
        "--structured-outputs-config",
        json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    ]
    with _both_serving(small_model_dir, logs, ipc, *outputs) as urls:
        yield urls


@pytest.fixture(scope="module")
def pooling_servers(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    logs, ipc = tmp_path_factory.mktemp("parity-pooling-logs"), tmp_path_factory.mktemp("ipc")
    with _both_serving(small_model_dir, logs, ipc, "--runner", "pooling") as urls:
        yield urls


def _answer(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and body of an answer (greedy, where it generates); a stream's chunks (or a Messages API
    stream's events), in order."""
    generates = path in ("/v1/completions", "/v1/chat/completions", "/v1/messages")
    asked = {"model": MODEL, **({"temperature": 0.0} if generates else {}), **body}
    if not body.get("stream"):
        response = httpx.post(f"{url}{path}", json=asked, timeout=300)
        return response.status_code, response.json()
    with httpx.stream("POST", f"{url}{path}", json=asked, timeout=300) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    if path != "/v1/messages":  # its events name their type; no [DONE] ends them
        assert events.pop() == "[DONE]"
    return response.status_code, [json.loads(event) for event in events]


def _differences(theirs: Any, ours: Any, where: str = "") -> list[str]:
    """Where kvfleet's answer differs from vLLM's: values, and keys (and their order in top_logprobs, where
    the chosen token comes first)."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        found = []
        for key in theirs.keys() | ours.keys():
            if key in OWN_FIELDS or (theirs.get(key) is None and key not in ours):
                continue
            if key not in theirs or key not in ours:
                found.append(f"{where}.{key}: only in {'kvfleet' if key in ours else 'vLLM'}'s")
            else:
                found += _differences(theirs[key], ours[key], f"{where}.{key}")
        if where.endswith("top_logprobs]") and list(theirs) != list(ours):
            found.append(f"{where}: in the order {list(ours)}, not {list(theirs)}")
        return found
    if isinstance(theirs, list) and isinstance(ours, list):
        if len(theirs) != len(ours):
            return [f"{where}: {len(ours)} items, not {len(theirs)}"]
        return [
            line
            for at, pair in enumerate(zip(theirs, ours, strict=True))
            for line in _differences(*pair, f"{where}[{at}]")
        ]
    if isinstance(theirs, float) and isinstance(ours, float):
        return [] if abs(theirs - ours) <= TOLERANCE else [f"{where}: {ours}, not {theirs}"]
    return [] if theirs == ours else [f"{where}: {ours!r}, not {theirs!r}"]


def _answers(urls: dict[str, str], path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's answer and kvfleet's to the same request, both of which must succeed."""
    (their_status, theirs), (our_status, ours) = (
        _answer(urls[name], path, body) for name in ("vllm", "kvfleet")
    )
    assert (our_status, their_status) == (200, 200), (ours, theirs)
    return theirs, ours


@pytest.mark.parametrize("case", list(CASES))
def test_kvfleet_answers_as_vllm_does(servers: dict[str, str], case: str) -> None:
    assert _differences(*_answers(servers, *CASES[case])) == []


def test_an_answer_cut_within_a_character_ends_in_a_replacement_character(servers: dict[str, str]) -> None:
    """The fifth token of this answer holds the first bytes of a character: vLLM's text leaves them out,
    kvfleet's ends in U+FFFD. Both name the token "" in logprobs, and all else is the same."""
    theirs, ours = _answers(servers, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "logprobs": 0})
    (their_choice,), (our_choice,) = theirs["choices"], ours["choices"]
    assert our_choice["text"] == their_choice["text"] + "\ufffd"
    assert our_choice["logprobs"]["tokens"][-1] == ""
    assert _differences(theirs, {**ours, "choices": [{**our_choice, "text": their_choice["text"]}]}) == []


def test_a_chat_echo_scores_its_prompt_when_asked(servers: dict[str, str]) -> None:
    """vLLM's server scores a chat echo's prompt as if prompt_logprobs were 0 (its default top_logprobs) and
    answers the scores; kvfleet's scores a prompt only when prompt_logprobs asks, as scoring it forgoes the
    prefix cache and a tensor-parallel engine (asked, the two answer the same: a case above)."""
    theirs, ours = _answers(servers, "/v1/chat/completions", CHAT_ECHO)
    assert theirs["prompt_logprobs"] and "prompt_logprobs" not in ours
    assert ours["choices"][0]["message"]["content"].startswith("Well")
    assert _differences({**theirs, "prompt_logprobs": None}, ours) == []


@pytest.mark.parametrize("case", list(POOLING_CASES))
def test_kvfleet_pools_as_vllm_does(pooling_servers: dict[str, str], case: str) -> None:
    assert _differences(*_answers(pooling_servers, *POOLING_CASES[case])) == []


@pytest.fixture(scope="module")
def reasoning_servers(
    make_small_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, str], Path]]:
    """Both servers on a small Qwen3 (whose tokenizer has <think> and </think>) with Qwen3's reasoning
    parser."""
    model = make_small_model("small-qwen3", "--arch", "qwen3")
    logs, ipc = tmp_path_factory.mktemp("parity-reasoning-logs"), tmp_path_factory.mktemp("ipc")
    with _both_serving(model, logs, ipc, "--reasoning-parser", "qwen3") as urls:
        yield urls, model


def test_a_thinking_token_budget_ends_the_reasoning_where_vllms_does(
    reasoning_servers: tuple[dict[str, str], Path],
) -> None:
    """Prompts that open the reasoning at their end or before it (its tokens after the start count), and a
    budget of none; the random model kept from ending its reasoning itself by a bias on </think>."""
    urls, model = reasoning_servers
    vocabulary = json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocabulary}
    start, end = ids["<think>"], ids["</think>"]
    for prompt, budget in (([17, 42, start], 3), ([17, start, 5, 6], 4), ([17, 42, start], 0)):
        body = {
            "prompt": prompt,
            "max_tokens": 8,
            "thinking_token_budget": budget,
            "logit_bias": {str(end): -100},
            "return_token_ids": True,
        }
        theirs, ours = _answers(urls, "/v1/completions", body)
        assert end in ours["choices"][0]["token_ids"]
        assert _differences(theirs, ours) == []
