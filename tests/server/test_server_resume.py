"""Continuations on the shared server: a stream cut after some of its chunks and resumed from the token ids
those chunks delivered (kvfleet.contract.resume) must add up, with the first part, to the same request
served without a cut: token for token, text for text, one finish per choice, one announcement per tool call,
the same usage. The oracle is the server's own uninterrupted stream of the same body."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest
from kvfleet.contract.resume import CONTINUATION, CONTINUATION_CHOICES
from server_checks import openai_error

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MAX_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]


@dataclass
class Sent:
    """What a stream delivered of one choice."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    logprobs: list[float] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)
    # Per call index: its announcements (name, id) and its arguments.
    announced: dict[int, list[str]] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)


@dataclass
class Stream:
    chunks: list[dict[str, Any]]
    usage: dict[str, int] | None


@pytest.fixture(scope="module")
def http(api_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=api_server.url, headers=api_server.headers(), timeout=60) as client:
        yield client


def _stream(http: httpx.Client, path: str, body: dict[str, Any]) -> Stream:
    body = {**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    chunks, usage, done = [], None, 0
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done += 1
                continue
            parsed = json.loads(data)
            assert "error" not in parsed, parsed
            if parsed.get("usage"):
                usage = parsed["usage"]
            if parsed["choices"]:
                chunks.append(parsed)
    assert done == 1
    return Stream(chunks, usage)


def _add(sent: dict[int, Sent], chunks: list[dict[str, Any]]) -> None:
    for chunk in chunks:
        (choice,) = chunk["choices"]
        got = sent.setdefault(choice["index"], Sent())
        got.token_ids += choice.get("token_ids") or []
        delta = choice.get("delta")
        if delta is None:  # completions
            got.text += choice["text"]
            if choice["logprobs"]:
                got.logprobs += choice["logprobs"]["token_logprobs"]
        else:
            got.text += delta.get("content") or ""
            got.reasoning += delta.get("reasoning_content") or ""
            if choice.get("logprobs"):
                got.logprobs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    got.announced.setdefault(call["index"], []).append(call["function"]["name"])
                got.arguments[call["index"]] = (
                    got.arguments.get(call["index"], "") + call["function"]["arguments"]
                )
        if choice.get("finish_reason"):
            got.finishes.append(choice["finish_reason"])


def _delivered(chunks: list[dict[str, Any]]) -> dict[int, Sent]:
    sent: dict[int, Sent] = {}
    _add(sent, chunks)
    return sent


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    (choice,) = chunk["choices"]
    return bool(choice.get("token_ids")) or bool(choice.get("finish_reason"))


def _cuts(whole: Stream) -> list[int]:
    """Where a stream is cut, in chunks: right after the preamble, after one token, halfway, before the
    last token's chunk, and after every token but before [DONE]."""
    token_chunks = [number for number, chunk in enumerate(whole.chunks, start=1) if _is_token_chunk(chunk)]
    first = token_chunks[0] - 1
    return sorted(
        {first, token_chunks[0], token_chunks[len(token_chunks) // 2], token_chunks[-2], len(whole.chunks)}
    )


def _continuation(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    choices = [
        {"index": index, "token_ids": got.token_ids, "finished": bool(got.finishes)}
        for index, got in sorted(_delivered(chunks).items())
    ]
    return {CONTINUATION_CHOICES: choices}


def _check_resumes(http: httpx.Client, path: str, body: dict[str, Any]) -> Stream:
    """The uninterrupted stream of `body`, after checking every cut of it resumes into the same answer."""
    whole = _stream(http, path, body)
    for choice in _delivered(whole.chunks).values():
        assert len(choice.finishes) == 1
        assert all(len(names) == 1 for names in choice.announced.values())
    for cut in _cuts(whole):
        _check_splice(http, path, body, whole, whole.chunks[:cut])
    return whole


def _check_splice(
    http: httpx.Client, path: str, body: dict[str, Any], whole: Stream, first: list[dict[str, Any]]
) -> None:
    """`first` (chunks of `whole`) and the continuation from them add up to `whole`."""
    expected = _delivered(whole.chunks)
    resumed = _stream(http, path, {**body, CONTINUATION: _continuation(first)})
    assert all("role" not in chunk["choices"][0].get("delta", {}) for chunk in resumed.chunks)
    spliced: dict[int, Sent] = {}
    _add(spliced, first)
    _add(spliced, resumed.chunks)
    cut = len(first)
    assert spliced.keys() == expected.keys(), cut
    for index, want in expected.items():
        got = spliced[index]
        assert got.token_ids == want.token_ids, (cut, index)
        assert got.text == want.text, (cut, index)
        assert got.reasoning == want.reasoning, (cut, index)
        assert got.finishes == want.finishes, (cut, index)
        assert got.announced == want.announced, (cut, index)
        assert got.arguments == want.arguments, (cut, index)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4), (cut, index)
    assert resumed.usage == whole.usage, cut


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **fields}


def test_a_greedy_completion_resumes_token_for_token(http: httpx.Client) -> None:
    _check_resumes(http, "/v1/completions", _completion(temperature=0))


def test_penalties_and_min_tokens_count_the_resumed_tokens(http: httpx.Client) -> None:
    body = _completion(temperature=0, frequency_penalty=1.5, repetition_penalty=1.3, min_tokens=MAX_TOKENS)
    _check_resumes(http, "/v1/completions", body)


def test_each_prompt_of_a_completion_resumes_by_its_choice_index_and_echoes_once(http: httpx.Client) -> None:
    # With logprobs, an echo leads with its prompt's: a choice not begun before the cut is echoed, and its
    # prompt scored, by the replica that resumes it.
    body = _completion(prompt=["Once upon a time", "The fox"], n=2, seed=1, echo=True, logprobs=1)
    _check_resumes(http, "/v1/completions", body)


def test_a_seeded_sampled_chat_resumes_its_random_stream(http: httpx.Client) -> None:
    _check_resumes(http, "/v1/chat/completions", _chat(temperature=1, seed=7))


def test_n_choices_with_logprobs_resume_each_once(http: httpx.Client) -> None:
    _check_resumes(http, "/v1/completions", _completion(n=2, temperature=1, seed=3, logprobs=2))
    whole = _check_resumes(http, "/v1/chat/completions", _chat(n=2, temperature=1, seed=5, logprobs=True))
    # Choice 0 delivered whole and finished, choice 1 cut halfway: only choice 1 runs again.
    first_of = [[chunk for chunk in whole.chunks if chunk["choices"][0]["index"] == i] for i in (0, 1)]
    first = first_of[0] + first_of[1][: len(first_of[1]) // 2]
    _check_splice(
        http, "/v1/chat/completions", _chat(n=2, temperature=1, seed=5, logprobs=True), whole, first
    )


def test_a_stop_string_straddling_the_cut_is_found(http: httpx.Client) -> None:
    plain = _delivered(_stream(http, "/v1/completions", _completion(temperature=0, max_tokens=40)).chunks)
    text = plain[0].text
    # A stop string from the middle of the answer, of characters whose tokens the cuts fall between.
    stop = next(text[i : i + 4] for i in range(len(text) // 3, len(text) - 4) if text[i : i + 4].strip())
    whole = _check_resumes(http, "/v1/completions", _completion(temperature=0, max_tokens=40, stop=[stop]))
    assert _delivered(whole.chunks)[0].finishes == ["stop"]


def test_a_json_schema_output_resumes_and_validates(http: httpx.Client) -> None:
    body = _chat(
        seed=11,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    whole = _check_resumes(http, "/v1/chat/completions", body)
    answer = _delivered(whole.chunks)[0]
    assert answer.finishes == ["stop"]
    jsonschema.validate(json.loads(answer.text), SCHEMA)


def test_a_tool_call_resumes_with_one_announcement(http: httpx.Client) -> None:
    body = _chat(seed=2, max_tokens=80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = _check_resumes(http, "/v1/chat/completions", body)
    answer = _delivered(whole.chunks)[0]
    assert answer.finishes == ["tool_calls"]
    assert answer.announced == {0: ["get_weather"]}
    jsonschema.validate(json.loads(answer.arguments[0]), WEATHER)


def test_resumed_requests_and_tokens_are_counted(http: httpx.Client) -> None:
    def counted() -> tuple[float, float]:
        text = http.get("/metrics").text

        def total(name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.MULTILINE))

        return total("kvfleet:resumed_requests"), total("kvfleet:resumed_tokens")

    before = counted()
    body = _completion(temperature=0, max_tokens=8)
    whole = _stream(http, "/v1/completions", body)
    continuation = _continuation(whole.chunks[:3])
    _stream(http, "/v1/completions", {**body, CONTINUATION: continuation})
    assert counted() == (before[0] + 1, before[1] + len(continuation[CONTINUATION_CHOICES][0]["token_ids"]))


def _refused(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return openai_error(http.post(path, json=body), 400)


def _choices(*choices: dict[str, Any]) -> dict[str, Any]:
    return {CONTINUATION_CHOICES: list(choices)}


def test_bad_continuations_are_refused(http: httpx.Client) -> None:
    vocab_size = http.get("/v1/models").json()["data"][0]["vocab_size"]
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    streamed = _completion(stream=True, n=2)
    cases = [
        ({**streamed, "stream": False}, _choices({"index": 0, "token_ids": [5]})),
        (streamed, _choices({"index": 2, "token_ids": [5]})),
        (streamed, _choices({"index": 1, "token_ids": [5]}, {"index": 1, "token_ids": [6]})),
        (streamed, _choices({"index": 0, "token_ids": [vocab_size]})),
        (streamed, _choices({"index": 0, "token_ids": [5] * (MAX_TOKENS + 1)})),
        (
            {"model": MODEL_NAME, "messages": MESSAGES, "stream": True},
            _choices({"index": 0, "token_ids": [5] * max_model_len}),
        ),
    ]
    for body, continuation in cases:
        error = _refused(
            http,
            "/v1/completions" if "prompt" in body else "/v1/chat/completions",
            {
                **body,
                CONTINUATION: continuation,
            },
        )
        assert error["param"] == CONTINUATION, (continuation, error)


def test_continuations_that_cannot_go_on_are_refused(http: httpx.Client) -> None:
    whole = _stream(http, "/v1/completions", _completion(temperature=0, max_tokens=6))
    tokens = _delivered(whole.chunks)[0].token_ids
    # All its tokens, but not finished: it would have stopped on the last (max_tokens).
    body = {
        **_completion(temperature=0, max_tokens=6, stream=True),
        CONTINUATION: _choices({"index": 0, "token_ids": tokens}),
    }
    assert _refused(http, "/v1/completions", body)["param"] == CONTINUATION
    # A token the JSON schema does not allow first ("x" is no start of an object).
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "x", "add_special_tokens": False})
    body = {
        **_chat(stream=True, response_format={"type": "json_object"}),
        CONTINUATION: _choices({"index": 0, "token_ids": tokenized.json()["tokens"]}),
    }
    assert _refused(http, "/v1/chat/completions", body)["param"] == CONTINUATION
