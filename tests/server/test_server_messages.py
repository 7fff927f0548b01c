"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the official anthropic
SDK (`client.messages.create`, `.stream`, `.count_tokens`) against the shared server: its text is the chat
endpoint's for the same greedy conversation, its streamed events rebuild the same message, its tool_use
blocks satisfy their tool's schema, a stop sequence and a prefilled answer end and begin as Anthropic's do,
the count is Transformers' chat template's, and errors come in Anthropic's shape with its error types."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import transformers
from anthropic.types import Message, RawMessageStreamEvent
from kvfleet.contract.errors import RequestTimeoutError
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.serving.messages_api import AnthropicServingMessages, PreparedMessage
from kvfleet.runtime.serving.messages_protocol import MessagesRequest
from kvfleet.runtime.serving.request import PreparedRequest
from pydantic import TypeAdapter
from server_checks import ROLE_CHUNK, TEXT_THEN_CALL_CHUNKS, ScriptedChatStream, chat_delta

if TYPE_CHECKING:
    from pathlib import Path

    from servers import ServerProcess

MODEL = "tiny"
SYSTEM = "Answer in one line."
PROMPT = "Once upon a time"
QUESTION = "What is the weather in Paris?"
# Anthropic's client no longer takes sampling fields; the server takes vLLM's (temperature, top_p, top_k).
GREEDY_SAMPLING = {"extra_body": {"temperature": 0.0}}
GREEDY: dict[str, Any] = {"model": MODEL, "max_tokens": 12, **GREEDY_SAMPLING}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather now.", "input_schema": WEATHER}
FORCED = {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=api_server.url, api_key=api_server.api_key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def chat_client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=120
    )


def _chat(chat_client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return chat_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_tokens=GREEDY["max_tokens"], **kwargs
    )


def _text(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_text_is_the_chat_endpoints_for_the_same_greedy_conversation(
    client: anthropic.Anthropic, chat_client: openai.OpenAI
) -> None:
    message = client.messages.create(system=SYSTEM, messages=[{"role": "user", "content": PROMPT}], **GREEDY)
    chat = _chat(chat_client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}])
    (choice,) = chat.choices
    # Every field the SDK's model requires is there (the client itself parses leniently).
    Message.model_validate(message.model_dump())
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert _text(message) and _text(message) == choice.message.content
    usage = message.usage
    # Without --enable-prompt-tokens-details, as vLLM's, the cache's share is not told apart.
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (chat.usage.prompt_tokens, None)
    assert usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]


def test_streamed_events_rebuild_the_message(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(messages=[{"role": "user", "content": PROMPT}], **GREEDY)
    with client.messages.stream(messages=[{"role": "user", "content": PROMPT}], **GREEDY) as stream:
        events = [event for event in stream if event.type in _RAW_EVENT_TYPES]
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].message.id


def test_a_forced_tool_is_used_as_its_schema_says_and_its_result_continues_the_conversation(
    client: anthropic.Anthropic, chat_client: openai.OpenAI
) -> None:
    asked = [{"role": "user", "content": QUESTION}]
    message = client.messages.create(model=MODEL, messages=asked, max_tokens=200, **GREEDY_SAMPLING, **FORCED)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and all(use.name == "get_weather" for use in uses) and message.stop_reason == "tool_use"
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    Message.model_validate(message.model_dump())
    with client.messages.stream(
        model=MODEL, messages=asked, max_tokens=200, **GREEDY_SAMPLING, **FORCED
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    assert streamed.stop_reason == "tool_use"

    answered = [
        *asked,
        {"role": "assistant", "content": [use.model_dump() for use in uses]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"} for use in uses],
        },
    ]
    # The tools stay declared; the shared server has no parser to read calls from free text ("auto").
    follow_up = client.messages.create(
        messages=answered, tools=[WEATHER_TOOL], tool_choice={"type": "none"}, **GREEDY
    )
    conversation = [
        *asked,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
                for use in uses
            ],
        },
        *({"role": "tool", "tool_call_id": use.id, "content": "21 C"} for use in uses),
    ]
    chat = _chat(chat_client, conversation, tools=[_chat_tool()], tool_choice="none")
    assert _text(follow_up) == (chat.choices[0].message.content or "")
    assert follow_up.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client: anthropic.Anthropic) -> None:
    text = _text(client.messages.create(messages=[{"role": "user", "content": PROMPT}], **GREEDY))
    # The last word of three letters or more that the text does not begin with.
    stop = [word.group() for word in re.finditer("[A-Za-z]{3,}", text) if word.start() > 0][-1]
    message = client.messages.create(
        messages=[{"role": "user", "content": PROMPT}], stop_sequences=["never written", stop], **GREEDY
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert _text(message) == text[: text.index(stop)]


def test_a_final_assistant_message_is_prefilled_and_the_answer_goes_on_with_it(
    client: anthropic.Anthropic, chat_client: openai.OpenAI
) -> None:
    prefill = "It was"
    conversation = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": prefill}]
    message = client.messages.create(messages=conversation, **GREEDY)  # type: ignore[arg-type]
    chat = _chat(
        chat_client,
        conversation,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert _text(message) == chat.choices[0].message.content


def test_the_count_is_the_chat_templates_prompt(client: anthropic.Anthropic, tiny_llama: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_llama))
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Yes."}]
    messages.append({"role": "user", "content": QUESTION})
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)  # type: ignore[arg-type]
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, *messages], add_generation_prompt=True, tokenize=True
    )
    assert counted.input_tokens == len(_token_ids(rendered))


def _token_ids(rendered: Any) -> list[int]:
    return rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered


@pytest.mark.parametrize(
    ("fields", "param_text"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "less than max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 2000}, "at least 1024"),
        # The shared server has no reasoning parser: its engine has no reasoning to count.
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000},
            "thinking_token_budget needs the engine started with a reasoning parser",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
            "server tool",
        ),
        ({"tool_choice": {"type": "tool", "name": "nowhere"}}, "'nowhere'"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document'"),
        ({"messages": []}, "messages must not be empty"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_is_not_served_is_refused_in_anthropics_shape(
    client: anthropic.Anthropic, fields: dict[str, Any], param_text: str
) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], **GREEDY, **fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**body)
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and param_text in error["message"]


def test_an_unknown_model_and_a_wrong_key_are_anthropics_errors(
    client: anthropic.Anthropic, api_server: ServerProcess
) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(
            **{**GREEDY, "model": "nowhere"}, messages=[{"role": "user", "content": PROMPT}]
        )
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    stranger = anthropic.Anthropic(base_url=api_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        stranger.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": PROMPT}])
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # The key as x-api-key, as Anthropic's API takes it (the SDK sends a bearer token), on every route.
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    for key, status in ((api_server.api_key, 200), ("wrong", 401)):
        headers = {"x-api-key": key or ""}
        counted = httpx.post(f"{api_server.url}/v1/messages/count_tokens", json=body, headers=headers)
        models = httpx.get(f"{api_server.url}/v1/models", headers=headers)
        assert (counted.status_code, models.status_code) == (status, status)


def test_blocks_become_the_chat_messages_they_mean() -> None:
    png = base64.b64encode(b"\x89PNG").decode()
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, _image(png)]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "3 C"}, _image(png)],
                        },
                        {"type": "text", "text": "And now?"},
                    ],
                },
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"},
        }
    )
    body.check()
    chat = body.chat_request()
    turns = [message.model_dump(exclude_none=True) for message in chat.messages]
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    assert turns == [
        {"role": "system", "content": "Be brief. Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image]},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "3 C", "tool_call_id": "t1"},
        {"role": "user", "content": [image]},
        {"role": "user", "content": "And now?"},
    ]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.reasoning_effort) == ("required", False, "none")
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_a_thinking_budget_is_vllms_thinking_token_budget() -> None:
    thinking = {"type": "enabled", "budget_tokens": 1500}
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 2000,
            "thinking": thinking,
            "messages": [{"role": "user", "content": "Hi"}],
        }
    )
    body.check()
    chat = body.chat_request()
    assert chat.thinking_token_budget == 1500 and chat.sampling_params().thinking_token_budget == 1500


def _image(data: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def _chat_tool() -> dict[str, Any]:
    parameters = WEATHER_TOOL["input_schema"]
    return {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather now.", "parameters": parameters},
    }


_RAW_EVENT_TYPES = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


def _streamed_events(chat: ScriptedChatStream) -> list[Any]:
    """The events a chat stream becomes, each validated as the SDK's own event type."""
    request = PreparedRequest(None, "msg-1", 0, MODEL, [[1, 2, 3]], SamplingParams(), 2, None, 0.0, None)  # type: ignore[arg-type]
    prepared = PreparedMessage(MessagesRequest(model=MODEL, max_tokens=4, messages=[]), request)

    async def collect() -> list[dict[str, Any]]:
        messages = AnthropicServingMessages(chat)  # type: ignore[arg-type]
        return [event async for event in messages.events(prepared, await messages.stream(prepared))]

    adapter = TypeAdapter(RawMessageStreamEvent)
    return [
        event if event["type"] == "error" else adapter.validate_python(event)
        for event in asyncio.run(collect())
    ]


# The reasoning first, as a reasoning parser streams it.
CHAT_CHUNKS = [
    ROLE_CHUNK,
    chat_delta({"reasoning_content": "Paris, "}),
    chat_delta({"reasoning_content": "surely."}),
    *TEXT_THEN_CALL_CHUNKS,
]


def test_a_chat_stream_becomes_the_sdks_events_in_block_order() -> None:
    events = _streamed_events(ScriptedChatStream(CHAT_CHUNKS))
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    assert [block.type for block in starts] == ["thinking", "text", "tool_use"]
    assert (starts[2].id, starts[2].name) == ("call_1", "get_weather")
    deltas: dict[int, str] = {}
    open_blocks: list[int] = []
    for event in events:
        if event.type == "content_block_start":
            assert not open_blocks  # each block stops before the next starts
            open_blocks.append(event.index)
        elif event.type == "content_block_delta":
            assert open_blocks == [event.index]
            piece = event.delta
            text = getattr(piece, "thinking", None) or getattr(piece, "text", None) or piece.partial_json
            deltas[event.index] = deltas.get(event.index, "") + text
        elif event.type == "content_block_stop":
            assert open_blocks.pop() == event.index
    assert deltas == {0: "Paris, surely.", 1: "Let me look.", 2: '{"city": "Paris"}'}
    message_delta = events[-2]
    assert message_delta.delta.stop_reason == "tool_use"
    assert (message_delta.usage.input_tokens, message_delta.usage.cache_read_input_tokens) == (1, 2)
    assert message_delta.usage.output_tokens == 9 and events[-1].type == "message_stop"


def test_a_stop_string_in_a_stream_is_its_stop_sequence() -> None:
    chunks = [chat_delta({"content": "Once"}), chat_delta({"content": " more"}, "stop", "\n\n")]
    message_delta = _streamed_events(ScriptedChatStream(chunks))[-2]
    assert (message_delta.delta.stop_reason, message_delta.delta.stop_sequence) == ("stop_sequence", "\n\n")


def test_a_failure_mid_stream_ends_in_an_anthropic_error_event() -> None:
    timeout = RequestTimeoutError("the request did not finish within its timeout", code="timeout")
    events = _streamed_events(ScriptedChatStream(CHAT_CHUNKS[:4], timeout))
    assert events[-1] == {"type": "error", "error": {"type": "timeout_error", "message": timeout.message}}
    assert [event.type for event in events[:-1]][-1] == "content_block_delta"
