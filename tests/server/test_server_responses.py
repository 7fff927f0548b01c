"""POST /v1/responses through the official openai SDK (`client.responses.create`, `.stream`, `.parse`,
`.retrieve`) against the shared server: its text is the chat endpoint's for the same greedy request, its
streamed events rebuild the same response, its calls satisfy their function's schema, and a follow-up by
previous_response_id is answered as the chat endpoint answers the whole conversation."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pydantic
import pytest
import transformers
from click.testing import CliRunner
from kvfleet.contract.errors import BadRequestError, RequestTimeoutError
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.serving.request import PreparedRequest
from kvfleet.runtime.serving.response_store import ResponseStore, StoredResponse
from kvfleet.runtime.serving.responses_api import OpenAIServingResponses, PreparedResponse
from kvfleet.runtime.serving.responses_protocol import ResponsesRequest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_checks import ROLE_CHUNK, TEXT_THEN_CALL_CHUNKS, ScriptedChatStream

from kvfleet.cli import cli

if TYPE_CHECKING:
    from pathlib import Path

    from servers import ServerProcess

MODEL = "tiny"
INSTRUCTIONS = "Answer in one line."
# Prompts the tiny model answers with text (for others it may end at once).
PROMPT = "Once upon a time"
QUESTION = "What is the weather in Paris?"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0.0, "max_output_tokens": 12}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=120
    )


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_tokens=GREEDY["max_output_tokens"], **kwargs
    )


def test_text_is_the_chat_endpoints_for_the_same_greedy_request(client: openai.OpenAI) -> None:
    response = client.responses.create(input=PROMPT, instructions=INSTRUCTIONS, **GREEDY)
    chat = _chat(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROMPT}])
    (choice,) = chat.choices
    assert response.output_text and response.output_text == choice.message.content
    # Every field the SDK's model requires is there (the client itself parses leniently).
    Response.model_validate(response.model_dump())
    assert response.object == "response" and response.model == MODEL
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.usage.total_tokens == chat.usage.total_tokens
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    # The same conversation as typed items: a developer message and input_text parts.
    items: Any = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": [{"type": "input_text", "text": PROMPT}]},
    ]
    assert client.responses.create(input=items, **GREEDY).output_text == response.output_text


def test_streamed_events_rebuild_the_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(input=PROMPT, **GREEDY)
    with client.responses.stream(input=PROMPT, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert (events[0].type, events[1].type, events[-1].type) == (
        "response.created",
        "response.in_progress",
        "response.completed",
    )
    assert {event.response.id for event in (events[0], events[-1])} == {final.id}
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status


def test_tool_calls_satisfy_their_schema_and_a_follow_up_continues_the_conversation(
    client: openai.OpenAI,
) -> None:
    calling: dict[str, Any] = {"tools": [WEATHER_TOOL], "tool_choice": "required", "temperature": 0.0}
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=200, **calling)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    Response.model_validate(response.model_dump())
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=200, **calling) as stream:
        argument_deltas = [
            event.delta for event in stream if event.type == "response.function_call_arguments.delta"
        ]
        streamed = stream.get_final_response()
    assert [call.arguments for call in streamed.output] == [call.arguments for call in calls]
    assert "".join(argument_deltas) == "".join(call.arguments for call in calls)

    outputs: Any = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"} for call in calls
    ]
    follow_up = client.responses.create(input=outputs, previous_response_id=response.id, **GREEDY)
    assert follow_up.previous_response_id == response.id
    conversation = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ],
        },
        *({"role": "tool", "tool_call_id": call.call_id, "content": "21 C"} for call in calls),
    ]
    chat = _chat(client, conversation)
    assert follow_up.usage.input_tokens == chat.usage.prompt_tokens
    assert follow_up.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(follow_up.id).model_dump() == follow_up.model_dump()


def _turn(number: int) -> list[dict[str, Any]]:
    words = " ".join(f"word{number}x{index}" for index in range(30))
    return [
        {"role": "user", "content": f"Turn {number}: {words}"},
        {"role": "assistant", "content": f"Noted {number}: {words}"},
    ]


def test_truncation_auto_drops_the_oldest_turns_the_context_cannot_hold(
    client: openai.OpenAI, tiny_llama: Path
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    context = 2048  # the tiny model's max_position_embeddings, the server's context
    turns = [_turn(number) for number in range(8)]
    question = {"role": "user", "content": QUESTION}
    instructions = {"role": "system", "content": INSTRUCTIONS}

    def kept(dropped: int) -> list[dict[str, Any]]:
        return [instructions, *(message for turn in turns[dropped:] for message in turn), question]

    def prompt_tokens(dropped: int) -> int:
        rendered = tokenizer.apply_chat_template(kept(dropped), add_generation_prompt=True, tokenize=True)
        return len(rendered["input_ids"])

    # OpenAI's "auto": the fewest oldest turns dropped that leave room for the output.
    dropped = next(d for d in range(len(turns)) if prompt_tokens(d) <= context - GREEDY["max_output_tokens"])
    assert 1 < dropped < len(turns)
    items: Any = kept(0)[1:]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=items, instructions=INSTRUCTIONS, **GREEDY)
    assert caught.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    response = client.responses.create(input=items, instructions=INSTRUCTIONS, truncation="auto", **GREEDY)
    chat = _chat(client, kept(dropped))
    assert response.truncation == "auto"
    assert response.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(dropped)
    assert response.output_text and response.output_text == chat.choices[0].message.content
    with client.responses.stream(
        input=items, instructions=INSTRUCTIONS, truncation="auto", **GREEDY
    ) as stream:
        assert stream.get_final_response().output_text == response.output_text

    # A last turn the context cannot hold alone is refused as without truncation.
    alone: Any = [*turns[0], {"role": "user", "content": " ".join(["word"] * 3000)}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=alone, truncation="auto", max_output_tokens=2)
    assert caught.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


class City(pydantic.BaseModel):
    # Bounded, so that the random model's answer ends within max_output_tokens.
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=10**9)


def test_a_json_schema_text_format_is_parsed_into_its_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL, input="Name a city.", text_format=City, max_output_tokens=300, temperature=0.0
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    jsonschema.validate(json.loads(parsed.output_text), City.model_json_schema())


def test_stored_responses_are_retrieved_deleted_and_not_kept_when_asked(client: openai.OpenAI) -> None:
    kept = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2)
    assert kept.store and client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, store=False)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=2, previous_response_id=unkept.id
        )
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0",
        ),
    ],
)
def test_what_is_not_served_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": MODEL, "input": PROMPT, "max_output_tokens": 2, **fields})
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_the_store_keeps_the_most_recently_used_responses() -> None:
    bound = 4
    store = ResponseStore(bound)
    ids = [f"resp-{number}" for number in range(bound + 2)]
    for response_id in ids[:bound]:
        store.put(response_id, StoredResponse({"id": response_id}, []))
    assert store.get(ids[0]) is not None  # used: now the most recent
    for response_id in ids[bound:]:
        store.put(response_id, StoredResponse({"id": response_id}, []))
    assert store.get(ids[1]) is None and store.get(ids[2]) is None
    assert all(store.get(response_id) is not None for response_id in [ids[0], *ids[3:]])


def test_without_a_store_previous_response_id_is_refused() -> None:
    responses = OpenAIServingResponses(service=None, store=None)  # type: ignore[arg-type]
    body = ResponsesRequest(input=PROMPT, previous_response_id="resp-1")
    with pytest.raises(BadRequestError, match="--max-stored-responses") as caught:
        asyncio.run(responses.create(body, None))
    assert caught.value.param == "previous_response_id"


def test_a_store_is_refused_beside_other_api_server_processes(tiny_llama: Path) -> None:
    # Each process would keep its own: a follow-up could reach one that never saw the response.
    flags = ["--max-stored-responses", "8", "--api-server-count", "2"]
    completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), *flags])
    assert completed.exit_code == 2
    assert "--max-stored-responses" in completed.output.splitlines()[-1]


def _streamed_events(chat: ScriptedChatStream) -> list[Any]:
    """The events a chat stream becomes, each validated as the SDK's own event type."""
    request = PreparedRequest(None, "resp-1", 0, MODEL, [[1, 2, 3]], SamplingParams(), 2, None, 0.0, None)  # type: ignore[arg-type]
    prepared = PreparedResponse(ResponsesRequest(input=PROMPT), request, [], stored=False)

    async def collect() -> list[dict[str, Any]]:
        responses = OpenAIServingResponses(chat, None)  # type: ignore[arg-type]
        return [event async for event in responses.events(prepared, await responses.stream(prepared))]

    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(event) for event in asyncio.run(collect())]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


# The Responses API's chat requests always count the cache's share of the prompt.
CHAT_CHUNKS = [ROLE_CHUNK, *TEXT_THEN_CALL_CHUNKS]


def test_a_chat_stream_becomes_the_sdks_typed_events() -> None:
    events = _streamed_events(ScriptedChatStream(CHAT_CHUNKS))
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.status == "completed"
    message, call = final.output
    assert message.content[0].text == "Let me look."
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert final.usage.input_tokens == 3 and final.usage.output_tokens == 9
    assert final.usage.input_tokens_details.cached_tokens == 2
    # Each item is done before the next is added.
    kinds = [(event.type, getattr(event, "output_index", None)) for event in events]
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))


def test_a_failure_mid_stream_ends_in_an_error_event_and_a_failed_response() -> None:
    timeout = RequestTimeoutError("the request did not finish within its timeout", code="timeout")
    events = _streamed_events(ScriptedChatStream(CHAT_CHUNKS[:3], timeout))
    error, failed = events[-2:]
    assert (error.type, error.code, error.message) == ("error", "timeout", timeout.message)
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error"
