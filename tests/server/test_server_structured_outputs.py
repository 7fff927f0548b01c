"""Structured outputs through the official openai SDK against real servers with random-weight models.

Every schema is asked for on each supported architecture (one server each), all of an architecture's requests
at once: on the llama greedy and sampled, streamed and not; on the others in one of those four ways each, in
turn. What an architecture changes is its tokenizer, whose vocabulary the grammar masks alike whichever way
the tokens are then chosen and sent.

Every schema here bounds its output (string lengths, array sizes, enums, integer ranges), as OpenAI's strict
mode expects of a schema, so that any output the grammar allows ends within the token budget: each answer
must then stop on its own (finish_reason "stop", never "length") and validate against its schema, every
time. Seeds make the sampled outputs, and so the test, repeatable.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from kvfleet.runtime.models.make_model import ARCHITECTURES
from processes import child_processes, descendants

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MAX_TOKENS = 400
COMPILE_WORKER_MODULE = "kvfleet.runtime.structured_outputs.compile_worker"

_NAME = {"type": "string", "maxLength": 8}
_SMALL_INT = {"type": "integer", "minimum": -5, "maximum": 120}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": _NAME, "age": _SMALL_INT, "active": {"type": "boolean"}},
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": _SMALL_INT, "address": {"type": "object", "properties": {"zip": _NAME}}},
                "required": ["id", "address"],
            }
        },
        "required": ["user"],
    },
    "three levels": {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": _SMALL_INT}}}}
        },
        "required": ["a"],
    },
    "array min and max items": {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 3},
    "array of objects": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": _NAME, "v": {"type": "boolean"}},
                    "required": ["k", "v"],
                },
                "maxItems": 2,
            }
        },
        "required": ["rows"],
    },
    "exact item count": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 2, "maxItems": 2},
    "array of arrays": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "maxItems": 2,
    },
    "tuple": {
        "type": "array",
        "prefixItems": [_NAME, _SMALL_INT, {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    },
    "string enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "mixed enum": {"enum": [1, "two", None, True, 2.5]},
    "const": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "n": _SMALL_INT},
        "required": ["version", "n"],
    },
    "anyOf scalars": {
        "type": "object",
        "properties": {"value": {"anyOf": [_SMALL_INT, _NAME, {"type": "null"}]}},
        "required": ["value"],
    },
    "anyOf objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": _SMALL_INT},
                "required": ["kind", "lives"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind", "good"],
            },
        ]
    },
    "nullable type list": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["nickname"],
    },
    "$ref and $defs": {
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/place"}, "work": {"$ref": "#/$defs/place"}},
        "required": ["home", "work"],
        "$defs": {
            "place": {
                "type": "object",
                "properties": {"city": _NAME, "floor": _SMALL_INT},
                "required": ["city", "floor"],
            }
        },
    },
    "$ref chain": {
        "$defs": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "item": {"type": "object", "properties": {"id": {"$ref": "#/$defs/id"}}, "required": ["id"]},
        },
        "type": "array",
        "items": {"$ref": "#/$defs/item"},
        "maxItems": 3,
    },
    "integer bounds": {"type": "integer", "minimum": 10, "maximum": 99},
    "negative integer bounds": {"type": "integer", "minimum": -1000, "maximum": -10},
    "exclusive integer bounds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    "integer multipleOf": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
    "number bounds": {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["ratio"],
    },
    "string length bounds": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "format date": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
    },
    "format time": {"type": "string", "format": "time"},
    "format uuid": {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}},
        "required": ["id"],
    },
    "format ipv4": {"type": "string", "format": "ipv4"},
    "additionalProperties false, optional fields": {
        "type": "object",
        "properties": {"a": _SMALL_INT, "b": _NAME, "c": {"type": "boolean"}},
        "required": ["b"],
        "additionalProperties": False,
    },
    "required subset": {
        "type": "object",
        "properties": {"x": {"type": "boolean"}, "y": {"type": "null"}},
        "required": ["y"],
    },
    "top-level boolean": {"type": "boolean"},
    "top-level null": {"type": "null"},
    "odd property names": {
        "type": "object",
        "properties": {
            "a b": {"type": "boolean"},
            'quote"d': {"type": "boolean"},
            "ünï": {"type": "boolean"},
        },
        "required": ["a b", 'quote"d', "ünï"],
    },
    "annotations": {
        "title": "Person",
        "description": "titles, descriptions and examples change nothing",
        "type": "object",
        "properties": {"n": {"title": "N", "description": "a number", "examples": [3], **_SMALL_INT}},
        "required": ["n"],
    },
}


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=120
    )


# The mixture-of-experts models are served in test_server_moe.py: grammars mask their logits as any model's.
@pytest.fixture(
    scope="module", params=[arch for arch in ARCHITECTURES if arch not in ("mixtral", "qwen3-moe")]
)
def server_of_each_architecture(
    request: pytest.FixtureRequest,
    make_model: Callable[..., Path],
    start_server: Callable[..., ServerProcess],
) -> Iterator[ServerProcess]:
    """A server of each supported architecture in turn (llama's is the shared one), stopped once done with."""
    if request.param == "llama":
        yield request.getfixturevalue("api_server")
        return
    server = start_server(model=make_model(request.param))
    yield server
    server.stop()


def _messages(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON ({name})."}]


def test_at_least_thirty_schemas_are_covered() -> None:
    assert len(SCHEMAS) >= 30


async def _answer(
    client: openai.AsyncOpenAI, index: int, name: str, decoding: str, stream: bool
) -> tuple[str, str | None]:
    """(text, finish_reason) of one request for a schema's JSON: on chat with response_format json_schema for
    even-numbered schemas, on completions with structured_outputs for the others."""
    schema = SCHEMAS[name]
    options: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "seed": index, "stream": stream}
    options["temperature"] = 0.0 if decoding == "greedy" else 1.0
    chat = index % 2 == 0
    if chat:
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        }
        response = await client.chat.completions.create(
            messages=_messages(name), response_format=response_format, **options
        )
    else:
        response = await client.completions.create(
            prompt=f"JSON for {name}:", extra_body={"structured_outputs": {"json": schema}}, **options
        )
    if not stream:
        choice = response.choices[0]
        return (choice.message.content or "" if chat else choice.text), choice.finish_reason
    text, finish_reason = "", None
    async for chunk in response:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


def test_every_answer_validates_against_its_schema(
    server_of_each_architecture: ServerProcess, request: pytest.FixtureRequest
) -> None:
    """Every schema, all at once, on each architecture: greedy and sampled, streamed and not on the llama; on
    the others one of those ways per schema, each way taken by chat and by completions requests alike."""
    server = server_of_each_architecture
    every_way = request.node.callspec.params["server_of_each_architecture"] == "llama"
    ways = [(decoding, stream) for decoding in ("greedy", "sampled") for stream in (False, True)]
    cases = [
        (index, name, decoding, stream)
        for index, name in enumerate(SCHEMAS)
        for decoding, stream in ways
        # Chat and completions alternate by index: a pair of schemas takes each way in turn.
        if every_way or (decoding, stream) == ways[index // 2 % len(ways)]
    ]

    async def run_all() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=server.api_key or "unused", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(_answer(client, *case) for case in cases))

    failures = []
    for (_, name, decoding, stream), (text, finish_reason) in zip(cases, asyncio.run(run_all()), strict=True):
        try:
            assert finish_reason == "stop", f"finish_reason {finish_reason}"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            label = f"{name}, {decoding}{', streamed' if stream else ''}"
            failures.append(f"{label}: {text!r}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_json_object_answers_are_json_objects(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.create(
            model=MODEL_NAME,
            messages=_messages("anything"),
            response_format={"type": "json_object"},
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        choice = completion.choices[0]
        # json_object bounds nothing: a cut answer is a prefix, a finished one an object.
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
        else:
            assert choice.finish_reason == "length"
            assert (choice.message.content or "").startswith("{")


def test_streamed_answer_validates(client: openai.OpenAI) -> None:
    schema = SCHEMAS["$ref and $defs"]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=_messages("streamed"),
        response_format={"type": "json_schema", "json_schema": {"name": "places", "schema": schema}},
        max_tokens=MAX_TOKENS,
        seed=5,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("structured", "matches"),
    [
        ({"regex": r"[a-f]{2,4}@[0-9]{1,3}"}, lambda text: re.fullmatch(r"[a-f]{2,4}@[0-9]{1,3}", text)),
        ({"choice": ["yes", "no", "maybe not"]}, lambda text: text in ("yes", "no", "maybe not")),
        (
            {"grammar": 'root ::= "(" num (", " num)* ")"\nnum ::= [1-9] [0-9]?'},
            lambda text: re.fullmatch(r"\([1-9][0-9]?(, [1-9][0-9]?)*\)", text),
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_always_match(client: openai.OpenAI, structured: dict, matches) -> None:
    for text in _sampled_answers(client, "pattern", {"structured_outputs": structured}, seeds=6):
        assert matches(text), text


def _sampled_answers(client: openai.OpenAI, name: str, constraint: dict[str, Any], seeds: int) -> list[str]:
    """The answers to a chat asking for `name`, under `constraint`, sampled with each seed; each one ended by
    its constraint."""
    answers = []
    for seed in range(seeds):
        completion = client.chat.completions.create(
            model=MODEL_NAME,
            messages=_messages(name),
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            extra_body=constraint,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        answers.append(choice.message.content or "")
    return answers


_CALL = {
    "type": "object",
    "properties": {"city": _NAME, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
# xgrammar's structural tag: the whole answer a tag around a JSON call.
_TAGGED_CALL = {
    "type": "tag",
    "begin": "<call>",
    "content": {"type": "json_schema", "json_schema": _CALL},
    "end": "</call>",
}


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "structural_tag", "format": _TAGGED_CALL}},
        {
            "structured_outputs": {
                "structural_tag": json.dumps({"type": "structural_tag", "format": _TAGGED_CALL})
            }
        },
    ],
    ids=["response_format", "structured_outputs"],
)
def test_a_structural_tag_holds_the_answer_to_its_tag_and_schema(
    client: openai.OpenAI, constraint: dict[str, Any]
) -> None:
    for text in _sampled_answers(client, "call", constraint, seeds=3):
        assert text.startswith("<call>") and text.endswith("</call>"), text
        jsonschema.validate(json.loads(text.removeprefix("<call>").removesuffix("</call>")), _CALL)


def test_vllms_older_structural_tag_holds_what_follows_each_trigger() -> None:
    """vLLM's older form (free text, and each trigger opens a tag whose content a schema holds), compiled as
    the engine compiles it, and fed texts by hand: a tag's content must be a call, anything else around."""
    import xgrammar
    from kvfleet.runtime.structured_outputs.grammars import build_grammar

    tag = {"type": "structural_tag", "structures": [{"begin": "<call>", "schema": _CALL, "end": "</call>"}]}
    grammar = build_grammar("structural_tag", json.dumps({**tag, "triggers": ["<call"]}))
    tokenizer = xgrammar.TokenizerInfo([chr(code) for code in range(32, 127)])
    compiled = xgrammar.GrammarCompiler(tokenizer).compile_grammar(grammar)

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return all(matcher.accept_token(ord(character) - 32) for character in text)

    call = json.dumps({"city": "Oslo", "days": 3}, separators=(",", ":"))
    assert accepts(f"Let me look. <call>{call}</call> and again <call>{call}</call> done")
    assert accepts("No call at all.")
    assert not accepts('Here: <call>{"city":"Oslo"}</call>')
    assert not accepts(f"<call>{call.replace('3', '12')}</call>")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    species: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)


class Household(pydantic.BaseModel):
    pets: list[Pet] = pydantic.Field(max_length=2)
    has_garden: bool


def test_parse_round_trips_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL_NAME,
            messages=_messages("household"),
            response_format=Household,
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Household)
        assert message.parsed == Household.model_validate_json(message.content or "")


def _nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
            "invalid json: schema at '/type'",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
                }
            },
            "response_format",
            "the keyword 'not'",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}},
                }
            },
            "response_format",
            "invalid json",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", None),
        # Found by the engine core's compiler: a 400 without a param.
        ({"structured_outputs": {"regex": "[a-z"}}, None, "invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, None, "invalid grammar"),
        ({"structured_outputs": {"regex": "(a"}, "stream": True}, None, "invalid regex"),
        (
            {"structured_outputs": {"json": {"$ref": "https://example.com/s.json"}}},
            "structured_outputs",
            "$ref",
        ),
        # As text: a body nesting as deep is refused before its fields are read.
        (
            {"structured_outputs": {"json": json.dumps(_nested_arrays(400))}},
            "structured_outputs",
            "deeper than 64",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not JSON"),
        (
            {"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": '}},
            "structured_outputs",
            "invalid structural_tag",
        ),
        (
            {
                "response_format": {
                    "type": "structural_tag",
                    "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                    "triggers": ["<b"],
                }
            },
            "response_format",
            "starts with none of the triggers",
        ),
        (
            {
                "response_format": {
                    "type": "structural_tag",
                    "format": {"type": "json_schema", "json_schema": {"not": {}}},
                }
            },
            "response_format",
            "the keyword 'not'",
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}},
            None,
            "invalid structural_tag",
        ),
        (
            {
                "response_format": {
                    "type": "structural_tag",
                    "format": {**_TAGGED_CALL, "content": {**_TAGGED_CALL["content"], "any_order": True}},
                }
            },
            "response_format",
            "any_order loosens its schema",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
            "not both",
        ),
    ],
    ids=[
        "unknown type",
        "unenforced keyword",
        "dangling $ref",
        "json_schema without schema",
        "unknown format type",
        "bad regex",
        "bad grammar",
        "bad regex, streamed",
        "remote $ref",
        "nested too deep",
        "empty choice",
        "two constraints",
        "schema text not JSON",
        "structural tag not JSON",
        "begin without its trigger",
        "unenforced keyword in a structural tag",
        "unknown structural tag format",
        "a structural tag's schema loosened",
        "both fields",
    ],
)
def test_bad_constraints_are_refused_with_a_400(
    api_server: ServerProcess, body: dict[str, Any], param: str | None, message: str | None
) -> None:
    response = httpx.post(
        f"{api_server.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": _messages("bad"), "max_tokens": 4, **body},
        headers=api_server.headers(),
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if message is not None:
        assert message in error["message"], error["message"]


def test_metrics_count_compilations_once_per_grammar_and_masked_steps(
    client: openai.OpenAI, api_server: ServerProcess
) -> None:
    before = api_server.metrics()
    # A grammar no other test uses, asked for twice: compiled once, then found in the cache.
    structured = {"regex": "metrics-[0-9]{2}"}
    sampled = 0
    for seed in range(2):
        completion = client.completions.create(
            model=MODEL_NAME,
            prompt="x",
            max_tokens=32,
            seed=seed,
            extra_body={"structured_outputs": structured},
        )
        assert re.fullmatch("metrics-[0-9]{2}", completion.choices[0].text)
        sampled += completion.usage.completion_tokens
    after = api_server.metrics()

    def grew(name: str) -> float:
        return after[f"kvfleet:{name}_total"] - before.get(f"kvfleet:{name}_total", 0.0)

    assert grew("structured_output_grammars_compiled") == 1
    assert grew("structured_output_compile_seconds") > 0
    # One request at a time: a step per token sampled, each through a mask.
    assert grew("structured_output_mask_steps") == sampled
    assert grew("structured_output_mask_seconds") > 0


def _slow_to_compile(repeats: int) -> dict[str, Any]:
    """A pattern whose grammar takes seconds to build (2 s for 900 repeats on one core, growing faster
    than their square): xgrammar writes the bounded repetition out in full (up to some 1600 repeats: from
    1700 on, it takes another path and builds one in a millisecond)."""
    return {"type": "string", "pattern": f"^([a-z]{{1,30}}-){{{repeats}}}$"}


# What an idle server's processes may burn in the measured window, where compilations left running would
# burn a core each (about 3 CPU seconds each on an idle machine).
_IDLE_WINDOW_S = 3.0
_IDLE_CPU_S = 0.6


def _cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds (user and system) of each live process among pids, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def test_a_grammar_that_compiles_too_long_fails_alone(start_server: Callable[..., ServerProcess]) -> None:
    """Four grammars that take many seconds to compile hold both compile places until each runs out of its
    time limit: their requests fail with a 400 and give their places to a grammar asked for after them, whose
    request is served, as is an unconstrained one. Their compilations are stopped, not left to run on: the
    server then burns next to no CPU, and at most two compile processes exist, forked from one compile
    server. Asked again, a grammar that ran out fails at once."""
    server = start_server("--structured-outputs-compile-timeout", "1")
    slow = [_slow_to_compile(repeats) for repeats in range(1500, 1504)]

    async def ask(client: openai.AsyncOpenAI, structured: dict[str, Any] | None) -> str | openai.APIError:
        try:
            completion = await client.completions.create(
                model=MODEL_NAME,
                prompt="x",
                max_tokens=16,
                seed=0,
                extra_body={"structured_outputs": structured} if structured else None,
            )
        except openai.APIError as error:
            return error
        return completion.choices[0].text

    def burned_cpu_seconds() -> tuple[float, tuple[set[int], set[int]]]:
        """CPU seconds the server's processes burn in a window, and after it the compile servers and the
        compile processes they forked."""
        before = _cpu_seconds([server.pid, *descendants(server.pid)])
        time.sleep(_IDLE_WINDOW_S)
        tree = descendants(server.pid)
        after = _cpu_seconds([server.pid, *tree])
        compilers = {pid for pid, command in tree.items() if COMPILE_WORKER_MODULE in command}
        forked = {child for pid in compilers for child in child_processes(pid)}
        burned = sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())
        return burned, (compilers - forked, forked)

    async def run() -> tuple[
        list[str | openai.APIError], tuple[float, tuple[set[int], set[int]]], list[str | openai.APIError]
    ]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            compiling = [asyncio.create_task(ask(client, {"json": schema})) for schema in slow]
            await asyncio.sleep(0.5)  # so that the slow grammars take the compile places first
            quick = [ask(client, {"regex": "quick-[0-9]{3}"}), ask(client, None)]
            first = await asyncio.gather(*compiling, *quick)
            burned = await asyncio.to_thread(burned_cpu_seconds)
            again = await asyncio.gather(
                ask(client, {"json": slow[0]}), ask(client, {"regex": "again-[a-z]"})
            )
            return first, burned, again

    try:
        (*timed_out, constrained, free), (cpu_seconds, (servers, compilers)), (timed_out_again, again) = (
            asyncio.run(run())
        )
    finally:
        server.stop()
    for error in [*timed_out, timed_out_again]:
        assert isinstance(error, openai.BadRequestError), error
        assert error.code == "grammar_compile_timeout"
        assert "took longer than 1 s to compile" in error.message
    assert isinstance(constrained, str) and re.fullmatch("quick-[0-9]{3}", constrained), constrained
    assert isinstance(free, str) and free, free
    assert isinstance(again, str) and re.fullmatch("again-[a-z]", again)
    assert cpu_seconds < _IDLE_CPU_S, f"{cpu_seconds:.2f} CPU seconds in {_IDLE_WINDOW_S} s of idleness"
    assert len(servers) == 1 and len(compilers) <= 2, (servers, compilers)


_CHECK_WITHOUT_TORCH = """
import sys
import kvfleet.runtime.server.app
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.structured_outputs.grammars import check_constraint
schema = {"type": "array", "items": {"$ref": "#/$defs/x"}, "$defs": {"x": {}}}
check_constraint(StructuredOutputsParams(json=schema))
print(sorted(name for name in ("torch", "xgrammar") if name in sys.modules))
"""


def test_api_servers_check_constraints_without_loading_torch() -> None:
    """API servers start fast and stay small: the checks they run need neither xgrammar nor torch."""
    result = subprocess.run(
        [sys.executable, "-P", "-c", _CHECK_WITHOUT_TORCH], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stderr
