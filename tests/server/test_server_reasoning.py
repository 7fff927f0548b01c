"""Reasoning output (--reasoning-parser qwen3) through the official openai SDK against a real server of a made
Qwen3 model, whose tokenizer has <think> and </think> as tokens. A logit_bias on </think> makes the random
model close its reasoning partway; the split is checked against the answer's token ids as Transformers'
tokenizer decodes them on either side of that token (the oracle), whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
from kvfleet.runtime.engine.outputs import CompletionOutput
from kvfleet.runtime.reasoning import reasoning_parser
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.serving.chat import ChatRoute
from kvfleet.runtime.serving.protocol import ChatCompletionRequest
from kvfleet.runtime.serving.request import PreparedRequest
from kvfleet.runtime.serving.responses import Choice
from kvfleet.runtime.serving.service import ServiceSettings
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def qwen3(make_model: Callable[..., Path]) -> Path:
    return make_model("qwen3", "tiny")


@pytest.fixture(scope="module")
def tokenizer(qwen3: Path) -> Any:
    return AutoTokenizer.from_pretrained(qwen3)


@pytest.fixture(scope="module")
def client(start_server: Callable[..., ServerProcess], qwen3: Path) -> openai.OpenAI:
    server = start_server("--reasoning-parser", "qwen3", model=qwen3)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _tag_ids(tokenizer: Any) -> tuple[int, int]:
    start_id, end_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return start_id, end_id


def _oracle(tokenizer: Any, ids: list[int]) -> tuple[str | None, str | None]:
    """The reasoning and content of an answer's token ids: what decodes before and after its first </think>,
    the opening tag left out."""
    start_id, end_id = _tag_ids(tokenizer)
    end = ids.index(end_id) if end_id in ids else len(ids)
    reasoning = tokenizer.decode([token for token in ids[:end] if token != start_id])
    return reasoning or None, tokenizer.decode(ids[end + 1 :]) or None


def _closing(client: openai.OpenAI, tokenizer: Any, opening: bool) -> dict[str, Any]:
    """A logit_bias and max_tokens under which the greedy answer closes its reasoning once, partway, and
    writes no tag after (with `opening`, after opening its reasoning itself)."""
    start_id, end_id = _tag_ids(tokenizer)
    for start_bias in range(3, 8) if opening else [None]:
        for end_bias in range(2, 8):
            logit_bias = {str(end_id): end_bias}
            if start_bias is not None:
                logit_bias[str(start_id)] = start_bias
            ids = _answer(client, logit_bias).choices[0].token_ids
            end = ids.index(end_id) if end_id in ids else 0
            if end < 3 or opening != (start_id in ids[:end]):
                continue
            next_tag = next((i for i in range(end + 1, len(ids)) if ids[i] in (start_id, end_id)), len(ids))
            if next_tag - end > 2:
                return {"logit_bias": logit_bias, "max_tokens": next_tag}
    raise AssertionError("no bias makes the model close its reasoning once")


def _answer(client: openai.OpenAI, logit_bias: dict[str, int], **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        logit_bias=logit_bias,
        extra_body={"return_token_ids": True, **fields.pop("extra_body", {})},
        **{"max_tokens": MAX_TOKENS, **fields},
    )


@pytest.mark.parametrize("opening", [False, True], ids=["tag-in-prompt", "tag-written"])
def test_reasoning_is_split_from_content_whole_and_streamed(
    client: openai.OpenAI, tokenizer: Any, opening: bool
) -> None:
    closing = _closing(client, tokenizer, opening)
    choice = _answer(client, **closing).choices[0]
    reasoning, content = _oracle(tokenizer, choice.token_ids)
    message = choice.message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert message.reasoning == reasoning
    for text in (reasoning, content):
        assert text and "<think>" not in text and "</think>" not in text

    deltas, token_ids = [], []
    for chunk in _answer(client, **closing, stream=True):
        for streamed in chunk.choices:
            deltas.append(streamed.delta)
            token_ids += getattr(streamed, "token_ids", None) or []
    assert token_ids == choice.token_ids
    reasoning_pieces = [
        delta.reasoning_content for delta in deltas if getattr(delta, "reasoning_content", None)
    ]
    assert [delta.reasoning for delta in deltas if getattr(delta, "reasoning", None)] == reasoning_pieces
    assert "".join(reasoning_pieces) == reasoning
    assert "".join(delta.content or "" for delta in deltas) == content
    first_content = next(i for i, delta in enumerate(deltas) if delta.content)
    assert not any(getattr(delta, "reasoning_content", None) for delta in deltas[first_content:])


def test_reasoning_left_out_when_not_to_be_included(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's include_reasoning false: the answer's content, whole and streamed, without its reasoning."""
    closing = _closing(client, tokenizer, opening=False)
    choice = _answer(client, **closing, extra_body={"include_reasoning": False}).choices[0]
    _, content = _oracle(tokenizer, choice.token_ids)
    assert choice.message.content == content and content
    assert (choice.message.reasoning_content, choice.message.reasoning) == (None, None)
    deltas, token_ids = [], []
    for chunk in _answer(client, **closing, stream=True, extra_body={"include_reasoning": False}):
        for streamed in chunk.choices:
            deltas.append(streamed.delta)
            token_ids += getattr(streamed, "token_ids", None) or []
    assert token_ids == choice.token_ids
    assert "".join(delta.content or "" for delta in deltas) == content
    assert not any(
        getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None) for delta in deltas
    )


def test_an_answer_cut_short_is_all_reasoning(client: openai.OpenAI, tokenizer: Any) -> None:
    choice = _answer(client, {}, max_tokens=12).choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.reasoning_content, choice.message.content) == (
        tokenizer.decode(choice.token_ids),
        None,
    )


def test_thinking_switched_off_answers_in_content_and_may_be_constrained(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    choice = _answer(client, {}, extra_body=off).choices[0]
    assert choice.message.reasoning_content is None
    assert choice.message.content == tokenizer.decode(choice.token_ids)

    json_object = {"type": "json_object"}
    with pytest.raises(openai.BadRequestError, match="enable_thinking") as refused:
        _answer(client, {}, response_format=json_object)
    assert refused.value.body["param"] == "response_format"
    constrained = _answer(client, {}, response_format=json_object, max_tokens=200, extra_body=off)
    assert isinstance(json.loads(constrained.choices[0].message.content), dict)


def test_responses_carry_the_reasoning_as_a_reasoning_item(client: openai.OpenAI) -> None:
    chat = _answer(client, {}, max_tokens=12).choices[0].message
    response = client.responses.create(
        model=MODEL_NAME, input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.content] == [chat.reasoning_content]
    assert message.type == "message" and response.output_text == ""

    events = list(
        client.responses.create(
            model=MODEL_NAME, input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0, stream=True
        )
    )
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    (done,) = [event.text for event in events if event.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done == chat.reasoning_content
    streamed = events[-1].response
    assert [item.type for item in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].content[0].text == chat.reasoning_content


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_thinking_token_budget_ends_the_reasoning_once_spent(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's thinking_token_budget on a prompt that opens the reasoning: the answer is the one without a
    budget up to the budget, then </think>."""
    start_id, end_id = _tag_ids(tokenizer)
    # The random model may close its reasoning itself: kept from it by a bias it cannot outweigh.
    asked = {
        "prompt": [17, 42, start_id],
        "max_tokens": 8,
        "temperature": 0.0,
        "logit_bias": {str(end_id): -100},
    }

    def token_ids(**extra: Any) -> list[int]:
        body = {"return_token_ids": True, **extra}
        completion = client.completions.create(model=MODEL_NAME, **asked, extra_body=body)  # type: ignore[call-overload]
        return completion.choices[0].token_ids  # type: ignore[attr-defined]

    free, budgeted = token_ids(), token_ids(thinking_token_budget=3)
    assert end_id not in free and budgeted[:4] == [*free[:3], end_id]


def test_tool_calls_are_read_from_the_content_alone(tokenizer: Any) -> None:
    """A call written in the reasoning stays reasoning; the one in the content is the answer's call, whole
    and streamed (the route fed the output token by token)."""
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in ("get_time", "get_weather")
    ]
    body = ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="auto")
    settings = ServiceSettings(MODEL_NAME, enable_auto_tool_choice=True, tool_call_parser="hermes")
    thought = f"Maybe {_call('get_weather', {'city': 'Paris'})} first."
    text = f"<think>{thought}</think>Let me look. {_call('get_time', {'zone': 3})}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text

    route = ChatRoute(body, settings)
    route.reasoning = reasoning_parser("qwen3", tokenizer)
    request = PreparedRequest(route, "chatcmpl-1", 0, MODEL_NAME, [[1]], SamplingParams(), 0, None, 0.0, None)
    whole = route.response(request, [[Choice(text, ids, finish_reason="stop")]], tokenizer, None)
    (choice,) = whole["choices"]
    assert choice["message"]["reasoning_content"] == thought
    assert choice["message"]["content"] == "Let me look. "
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_time"]

    builder = route.choice_builder(request, tokenizer, {})
    deltas = []
    for end in range(1, len(ids) + 1):
        piece = tokenizer.decode(ids[:end])[len(tokenizer.decode(ids[: end - 1])) :]
        finish = "stop" if end == len(ids) else None
        output = CompletionOutput(0, piece, ids[end - 1 : end], None, None, finish_reason=finish)
        deltas += [streamed["delta"] for streamed in builder(0, output, finish is not None)]
    assert "".join(delta.get("reasoning_content") or "" for delta in deltas) == thought
    assert "".join(delta.get("content") or "" for delta in deltas) == "Let me look. "
    calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    assert [call["function"]["name"] for call in calls if "id" in call] == ["get_time"]
    assert json.loads("".join(call["function"]["arguments"] for call in calls)) == {"zone": 3}


def test_a_continuation_goes_on_reasoning_or_answering(client: openai.OpenAI, tokenizer: Any) -> None:
    """A stream cut before, at and after the token that closes the reasoning, and resumed from the ids it
    delivered (kvfleet.contract.resume), splits the same as the whole stream."""
    closing = _closing(client, tokenizer, opening=False)

    def split(chunks: list[Any]) -> tuple[str, str, list[int]]:
        reasoning, content, token_ids = "", "", []
        for chunk in chunks:
            for streamed in chunk.choices:
                reasoning += getattr(streamed.delta, "reasoning_content", None) or ""
                content += streamed.delta.content or ""
                token_ids += getattr(streamed, "token_ids", None) or []
        return reasoning, content, token_ids

    chunks = list(_answer(client, **closing, stream=True))
    whole = split(chunks)
    end_id = _tag_ids(tokenizer)[1]
    closed_at = next(n for n, chunk in enumerate(chunks, 1) if end_id in (split([chunk])[2]))
    for cut in (closed_at - 1, closed_at, closed_at + 1):
        first = split(chunks[:cut])
        continuation = {"choices": [{"index": 0, "token_ids": first[2]}]}
        rest = split(list(_answer(client, **closing, stream=True, extra_body={"continuation": continuation})))
        assert (first[0] + rest[0], first[1] + rest[1], first[2] + rest[2]) == whole, cut
