"""Tool calls on /v1/chat/completions through the official openai SDK against real servers.

`required` and a named function constrain the random model's output, so every answer must parse into calls
whose arguments validate against their function's schema (jsonschema decides). Under `auto` a random model
writes no calls of its own, so those tests constrain its text with structured_outputs into the parser's
format (or a malformed variant of it) and check what the parser makes of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import openai
import pytest
from kvfleet.runtime.json_depth import MAX_JSON_DEPTH
from kvfleet.runtime.serving.protocol import ChatCompletionRequest
from kvfleet.runtime.serving.tool_calls import TOOL_CALL_PARSERS, ToolCalling
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MAX_TOKENS = 300
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key or "unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return _client(api_server)


@pytest.fixture(scope="module")
def auto_server(start_server: Callable[..., ServerProcess]) -> Callable[[str], ServerProcess]:
    """parser name -> a server with tool_choice auto read by that parser."""
    servers: dict[str, ServerProcess] = {}

    def get(parser: str) -> ServerProcess:
        if parser not in servers:
            servers[parser] = start_server("--enable-auto-tool-choice", "--tool-call-parser", parser)
        return servers[parser]

    return get


def _assert_valid_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_answers_are_calls_with_valid_arguments(client: openai.OpenAI, parallel: bool) -> None:
    for seed in range(6):
        completion = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _assert_valid_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    for seed in range(4):
        completion = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        _assert_valid_calls([call])


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""
    fragments: int = 0


def _streamed_calls(chunks: list[Any]) -> list[StreamedCall]:
    """The calls of a streamed answer, put together from its deltas the way OpenAI's streams are read: each
    call is announced first (index, id, type and name, arguments ""), then its argument fragments follow."""
    calls: list[StreamedCall] = []
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index == len(calls):
                assert delta.type == "function"
                assert delta.id.startswith("call_")
                assert delta.function.arguments == ""
                calls.append(StreamedCall(delta.id, delta.function.name))
            else:
                assert delta.index < len(calls)
                assert delta.id is None and delta.function.name is None
                call = calls[delta.index]
                call.arguments += delta.function.arguments
                call.fragments += 1
    return calls


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_calls_send_their_arguments_as_they_are_written(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    for seed in range(3):
        kwargs = {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": MAX_TOKENS,
            "seed": seed,
        }
        whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        streamed = _streamed_calls(chunks)
        assert [(call.name, call.arguments) for call in streamed] == [
            (call.function.name, call.function.arguments) for call in whole
        ]
        for call in streamed:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            # Every call's arguments hold at least two members: they cannot come in one token.
            assert call.fragments > 1, call


def test_tool_choice_none_answers_with_content(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, seed=0
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_calls_and_results_in_the_history_are_rendered_by_the_chat_template(
    client: openai.OpenAI, tiny_llama: Any
) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    # Transformers renders the same conversation (arguments as an object, as its templates take them).
    rendered = [dict(message) for message in history]
    rendered[1] = {
        **history[1],
        "content": "",
        "tool_calls": [
            {
                **history[1]["tool_calls"][0],
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            }
        ],
    }
    expected = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        rendered, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert completion.usage.prompt_tokens == len(expected)
    without_tools = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert completion.usage.prompt_tokens > without_tools.usage.prompt_tokens + 40


LLAMA3_CALL = r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{2,6}", "unit": "c"\}\}'
HERMES_CALL = (
    r'Sure\. <tool_call>\{"name": "get_weather", '
    r'"arguments": \{"city": "[a-z]{2,6}", "unit": "f"\}\}</tool_call>'
)


def _auto_kwargs(regex: str, seed: int) -> dict[str, Any]:
    """A request under tool_choice auto whose output the regex dictates."""
    return {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
        "seed": seed,
        "extra_body": {"structured_outputs": {"regex": regex}},
    }


@pytest.mark.parametrize(
    ("parser", "regex", "content"),
    [
        ("llama3_json", LLAMA3_CALL, None),
        ("llama3_json", f"{LLAMA3_CALL}; {LLAMA3_CALL}", None),
        ("hermes", HERMES_CALL, "Sure. "),
    ],
    ids=["llama3_json", "llama3_json parallel", "hermes"],
)
def test_auto_reads_calls_from_the_output(
    auto_server: Callable[[str], ServerProcess], parser: str, regex: str, content: str | None
) -> None:
    client = _client(auto_server(parser))
    kwargs = _auto_kwargs(regex, seed=1)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    assert len(choice.message.tool_calls) == regex.count("get_weather")
    _assert_valid_calls(choice.message.tool_calls)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_content == (content or "")
    streamed = _streamed_calls(chunks)
    assert [(call.name, call.arguments) for call in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert all(call.fragments > 1 for call in streamed)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("parser", "regex"),
    [
        # An unknown function, arguments that are not an object, a call left open.
        ("llama3_json", r'\{"name": "get_wind", "parameters": \{\}\}'),
        ("llama3_json", r'\{"name": "get_weather", "parameters": "[a-z]{3}"\}'),
        ("hermes", r'ok <tool_call>\{"name": "get_weather", "arguments": \{\}\}'),
        ("hermes", r"[a-z ]{5,20}\."),
    ],
    ids=["unknown function", "arguments not an object", "unclosed call", "plain text"],
)
def test_auto_leaves_malformed_calls_as_content(
    auto_server: Callable[[str], ServerProcess], parser: str, regex: str
) -> None:
    client = _client(auto_server(parser))
    kwargs = _auto_kwargs(regex, seed=2)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "'not'",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "distinct"),
    ],
    ids=[
        "tools default to auto",
        "auto",
        "required without tools",
        "unknown name",
        "with response_format",
        "bad schema",
        "same name twice",
    ],
)
def test_tool_requests_the_server_cannot_serve_get_a_400(
    api_server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    response = httpx.post(
        f"{api_server.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **body},
        headers=api_server.headers(),
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"], error["message"]


def _long_call(parser: str | None, length: int) -> str:
    """An output with one call whose arguments are about `length` characters, in the format of `parser`
    (None: tool_choice `required`)."""
    arguments = json.dumps({"city": "x" * length, "unit": "c"})
    if parser == "hermes":
        return f'Checking. <tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    if parser == "llama3_json":
        return f'{{"name": "get_weather", "parameters": {arguments}}}'
    return f'[{{"name": "get_weather", "parameters": {arguments}}}]'


def _seconds_to_stream(tool_calling: ToolCalling, text: str) -> float:
    """CPU seconds to read `text` streamed in deltas of 3 characters (about a token each); the streamed
    reading must end as reading the whole text at once does."""
    reader = tool_calling.reader()
    # CPU time, not wall time: on a loaded machine, wall time is mostly how often the test was preempted.
    start = time.process_time()
    for position in range(0, len(text), 3):
        reading = reader.read(text[position : position + 3])
    seconds = time.process_time() - start
    assert reader.text == text
    assert reading.parsed(text) == tool_calling.extract(text)
    assert tool_calling.extract(text)[1] != []
    return seconds


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", None], ids=["hermes", "llama3_json", "required"])
def test_streamed_calls_are_read_in_time_linear_in_their_length(parser: str | None) -> None:
    """Each delta of a streamed output costs about its own length: a call four times as long takes about four
    times as long to read delta by delta (reading the whole output again at each delta took sixteen), and
    the streamed reading ends as the reading of the whole output does."""
    body = ChatCompletionRequest.model_validate(
        {
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "auto" if parser else "required",
        }
    )
    tool_calling = ToolCalling.of(body, parser, auto_enabled=True)
    assert tool_calling is not None
    # The best of a few runs.
    short, long = (
        min(_seconds_to_stream(tool_calling, _long_call(parser, length)) for _ in range(3))
        for length in (3000, 12000)
    )
    assert long < 8 * short, f"{short * 1000:.1f} ms for 3000 characters, {long * 1000:.1f} ms for 12000"


def _nested_call(parser: str, depth: int) -> tuple[str, str]:
    """(output, arguments) of a call whose arguments hold a list nested `depth` deep: the call's JSON nests
    two levels more."""
    arguments = '{"city": ' + "[" * depth + "]" * depth + "}"
    call = f'{{"name": "get_weather", "{"arguments" if parser == "hermes" else "parameters"}": {arguments}}}'
    return (f"<tool_call>{call}</tool_call>" if parser == "hermes" else call), arguments


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_a_call_nested_past_the_json_limit_is_content(parser: str) -> None:
    read = TOOL_CALL_PARSERS[parser]({"get_weather"}).read
    text, arguments = _nested_call(parser, MAX_JSON_DEPTH - 2)
    content, calls = read(text).parsed(text)
    assert content is None and [call.arguments for call in calls] == [arguments]
    # Output nested a few thousand deep made reading it raise RecursionError: a 500, or a failed batch line.
    text, _ = _nested_call(parser, 5000)
    assert read(text).parsed(text) == (text, [])
