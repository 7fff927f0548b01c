"""Tool calls on /v1/chat/completions: what tool_choice makes of the output, and how calls are read from it.

- `none`: the output is content.
- `auto` (needs --enable-auto-tool-choice and --tool-call-parser): the model may write calls in its chat
  format among its text; the parser takes out the well-formed ones, and anything malformed stays content.
- `required`: the output is constrained to a JSON array of calls, {"name": ..., "parameters": {...}}, each
  naming a given function with arguments its schema accepts (one call only without parallel_tool_calls).
- a named function: the output is constrained to that function's arguments.

Parsers: `hermes` (Qwen's and Hermes' format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
and `llama3_json` (Llama 3's: the whole output is `{"name": ..., "parameters": {...}}`, calls separated by
`;`).

Outputs are read as they grow (`read`), so that streaming can announce a call once its name is written and
send its arguments as they come; a call's arguments are the model's own text, streamed or not.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime import json_depth
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.server.errors import BadRequestError
from kvfleet.runtime.server.protocol import ChatCompletionRequest, Tool

# A function without parameters takes an empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_JSON_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    # The arguments as JSON text, as the model wrote them.
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallReading:
    """A call in an output, as far as it is written: the span of its JSON object and of its arguments."""

    start: int
    name: str | None = None
    arguments_start: int | None = None
    # None while unfinished.
    arguments_end: int | None = None
    end: int | None = None

    def arguments(self, text: str) -> str:
        """The arguments written so far (all of them once `arguments_end` is known)."""
        if self.arguments_start is None:
            return ""
        return text[
            self.arguments_start : self.arguments_end if self.arguments_end is not None else len(text)
        ]


@dataclass
class OutputReading:
    """What an output holds, read as far as it goes."""

    # The text before this index is content, whatever follows it.
    content_end: int = 0
    # The text outside calls so far.
    content: str = ""
    calls: list[CallReading] = field(default_factory=list)
    # The output strays from the format (which more text cannot mend): all of it is content.
    malformed: bool = False
    # The output ends inside a call.
    inside_call: bool = False

    def parsed(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output; the text whole as content, and no calls, unless every call
        is well formed (its object valid JSON: reading only matches brackets) and closed."""
        if self.malformed or self.inside_call or not self.calls:
            return text, []
        calls = []
        for call in self.calls:
            assert call.name is not None and call.end is not None
            try:
                json_depth.loads(text[call.start : call.end])
            except (json.JSONDecodeError, json_depth.JSONTooDeepError):
                return text, []
            calls.append(ParsedCall(call.name, call.arguments(text)))
        # Not stripped: what came before the first call may have been streamed already, as it is.
        return (self.content if self.content.strip() else None), calls


class ToolCallParser(ABC):
    """Reads calls written by the model among free text."""

    def __init__(self, function_names: set[str]) -> None:
        self.function_names = function_names

    @abstractmethod
    def read(self, text: str) -> OutputReading:
        """The calls and content of an output, finished or not."""


class HermesToolCallParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def read(self, text: str) -> OutputReading:
        reading = OutputReading(content_end=self._content_end(text))
        position = 0
        while True:
            start = text.find(self.START, position)
            if start < 0:
                reading.content += text[position:]
                return reading
            reading.content += text[position:start]
            call = _read_call(
                text, _skip_whitespace(text, start + len(self.START)), ("arguments",), self.function_names
            )
            if call is None:
                reading.malformed = True
                return reading
            reading.calls.append(call)
            after = len(text) if call.end is None else _skip_whitespace(text, call.end)
            if not text.startswith(self.END, after):
                reading.inside_call = self.END.startswith(text[after:])
                reading.malformed = not reading.inside_call
                return reading
            position = after + len(self.END)

    def _content_end(self, text: str) -> int:
        """Content may be streamed up to the first call, and short of a tail that may begin one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        for length in range(min(len(self.START) - 1, len(text)), 0, -1):
            if text.endswith(self.START[:length]):
                return len(text) - length
        return len(text)


class Llama3JsonToolCallParser(ToolCallParser):
    def read(self, text: str) -> OutputReading:
        position = _skip_whitespace(text, 0)
        if position == len(text):
            return OutputReading()
        if text[position] != "{":
            return OutputReading(content_end=len(text), content=text, malformed=True)
        reading = OutputReading()
        while position < len(text):
            # Llama's format names the arguments "parameters"; some of its fine-tunes write "arguments".
            call = _read_call(text, position, ("parameters", "arguments"), self.function_names)
            if call is None:
                reading.malformed = True
                return reading
            reading.calls.append(call)
            if call.end is None:
                reading.inside_call = True
                return reading
            # Calls are separated by ";" (or only by whitespace).
            position = _skip_whitespace(text, call.end)
            if text.startswith(";", position):
                position = _skip_whitespace(text, position + 1)
            if position < len(text) and text[position] != "{":
                reading.malformed = True
                return reading
        return reading


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
}


class ToolCalling:
    """One request's tool_choice: the constraint it puts on the output, and how calls are read from it."""

    def __init__(self, mode: str, tools: list[Tool], parser: ToolCallParser | None, parallel: bool) -> None:
        self.mode = mode  # "auto", "required" or the name of the function to call
        self.tools = {tool.function.name: tool for tool in tools}
        self.parser = parser
        self.parallel = parallel

    @classmethod
    def of(
        cls, body: ChatCompletionRequest, parser_name: str | None, auto_enabled: bool
    ) -> ToolCalling | None:
        """None when the output is plain content; BadRequestError for a tool_choice that cannot be served."""
        tools = body.tools or []
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none":
            return None
        if not tools:
            raise BadRequestError("tool_choice other than none needs tools", param="tool_choice")
        names = [tool.function.name for tool in tools]
        if len(set(names)) < len(names):
            raise BadRequestError("tools must have distinct function names", param="tools")
        if choice == "auto":
            if not auto_enabled or parser_name is None:
                raise BadRequestError(
                    'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                    "--tool-call-parser",
                    param="tool_choice",
                )
            parser = TOOL_CALL_PARSERS[parser_name](set(names))
            return cls("auto", tools, parser, body.parallel_tool_calls)
        if choice == "required":
            return cls("required", tools, None, body.parallel_tool_calls)
        assert not isinstance(choice, str)
        if choice.function.name not in names:
            raise BadRequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return cls(choice.function.name, tools, None, body.parallel_tool_calls)

    def constraint(self) -> StructuredOutputsParams | None:
        """What `required` and a named function constrain the output to; `auto` leaves it free."""
        if self.mode == "auto":
            return None
        if self.mode != "required":
            return StructuredOutputsParams(json=self._parameters(self.mode))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": self._parameters(name)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def read(self, text: str) -> OutputReading:
        """The calls and content of an output, finished or not."""
        if self.parser is not None:
            reading = self.parser.read(text)
            # A second call where parallel calls are not allowed makes the whole output content.
            reading.malformed |= not self.parallel and len(reading.calls) > 1
            return reading
        if self.mode != "required":
            # The whole output is the named function's arguments.
            return OutputReading(calls=[CallReading(0, self.mode, 0, len(text), len(text))])
        # The grammar writes `[call, call, ...]`.
        reading = OutputReading()
        position = _skip_whitespace(text, 1)
        while position < len(text) and text[position] != "]":
            call = _read_call(text, position, ("parameters",), self.tools)
            assert call is not None, "the grammar only lets calls through"
            reading.calls.append(call)
            if call.end is None:
                break
            position = _skip_whitespace(text, call.end)
            if text.startswith(",", position):
                position = _skip_whitespace(text, position + 1)
        reading.inside_call = not text.endswith("]")
        return reading

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of an output that finished with "stop". A constrained output that did not finish
        (a stop string) is not JSON, and stays content."""
        return self.read(text).parsed(text)

    def _parameters(self, name: str) -> dict[str, Any]:
        parameters = self.tools[name].function.parameters
        return parameters if parameters is not None else _NO_PARAMETERS


def _read_call(
    text: str, start: int, arguments_keys: tuple[str, ...], function_names: Collection[str]
) -> CallReading | None:
    """Reads `{"name": ..., "<one of arguments_keys>": {...}}` (members in either order) from `start`, as far
    as the text goes; None where it strays from that shape: other members, a function not among
    `function_names`, arguments that are not an object. The arguments' brackets are matched, not checked:
    finished outputs are parsed whole (OutputReading.parsed)."""
    call = CallReading(start)
    if start == len(text):
        return call
    if text[start] != "{":
        return None
    position = start + 1
    first = True
    while True:
        position = _skip_whitespace(text, position)
        if position == len(text):
            return call
        if text[position] == "}" and call.name is not None and call.arguments_end is not None:
            call.end = position + 1
            return call
        if not first:
            if text[position] != ",":
                return None
            position = _skip_whitespace(text, position + 1)
            if position == len(text):
                return call
        first = False
        key_end = _string_end(text, position)
        if key_end is None:
            return call if position < len(text) and text[position] == '"' else None
        key = _string_value(text[position:key_end])
        position = _skip_whitespace(text, key_end)
        if position == len(text):
            return call
        if text[position] != ":":
            return None
        position = _skip_whitespace(text, position + 1)
        if position == len(text):
            return call
        if key == "name" and call.name is None:
            name_end = _string_end(text, position)
            if name_end is None:
                return call if text[position] == '"' else None
            name = _string_value(text[position:name_end])
            if name not in function_names:
                return None
            call.name, position = name, name_end
        elif key in arguments_keys and call.arguments_start is None:
            if text[position] != "{":
                return None
            call.arguments_start = position
            call.arguments_end = _object_end(text, position)
            if call.arguments_end is None:
                return call
            position = call.arguments_end
        else:
            return None


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _JSON_WHITESPACE:
        position += 1
    return position


def _string_end(text: str, start: int) -> int | None:
    """The index after the JSON string opening at `start`; None where none opens there or it is unfinished."""
    if start >= len(text) or text[start] != '"':
        return None
    position = start + 1
    while position < len(text):
        character = text[position]
        if character == "\\":
            position += 2
        elif character == '"':
            return position + 1
        else:
            position += 1
    return None


def _string_value(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object opening at `start`, found by matching brackets outside strings; None
    while it is unfinished."""
    depth = 0
    position = start
    while position < len(text):
        character = text[position]
        if character == '"':
            string_end = _string_end(text, position)
            if string_end is None:
                return None
            position = string_end
            continue
        if character in "{[":
            depth += 1
        elif character in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None
