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

Outputs are read as they grow (an OutputReader per output, fed each delta), so that streaming can announce a
call once its name is written and send its arguments as they come; a call's arguments are the model's own
text, streamed or not. A reader reads what is settled (calls closed, the content before them) once, and
scans that stopped at the end of the text go on from there: each delta costs about its own length, not the
output's.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime import json_depth
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.serving.protocol import ChatCompletionRequest, Tool

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

    def arguments(self, text: str, skip: int = 0) -> str:
        """The arguments written so far (all of them once `arguments_end` is known), past their first `skip`
        characters."""
        if self.arguments_start is None:
            return ""
        return text[
            self.arguments_start + skip : self.arguments_end if self.arguments_end is not None else len(text)
        ]


@dataclass
class OutputReading:
    """What an output holds, read as far as it goes."""

    # The text before this index is content, whatever follows it.
    content_end: int = 0
    # The text outside calls so far, as (start, end) spans.
    content_spans: list[tuple[int, int]] = field(default_factory=list)
    calls: list[CallReading] = field(default_factory=list)
    # The output strays from the format (which more text cannot mend): all of it is content.
    malformed: bool = False
    # The output ends inside a call.
    inside_call: bool = False

    def content(self, text: str) -> str:
        return "".join(text[start:end] for start, end in self.content_spans)

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
        content = self.content(text)
        return (content if content.strip() else None), calls


class GrowingText:
    """An output as it grows, with JSON scans that remember, by where they start, how far they got: asked
    again after the text has grown, a scan goes on from there instead of starting over."""

    def __init__(self) -> None:
        self.text = ""
        self._whitespace_ends: dict[int, int] = {}
        self._searched: dict[tuple[str, int], int] = {}
        # (where the scan stopped, whether it found the end)
        self._strings: dict[int, tuple[int, bool]] = {}
        # (where the scan stopped, bracket depth, inside a string, whether it found the end)
        self._objects: dict[int, tuple[int, int, bool, bool]] = {}

    def extend(self, delta: str) -> None:
        self.text += delta

    def skip_whitespace(self, position: int) -> int:
        text = self.text
        end = self._whitespace_ends.get(position, position)
        while end < len(text) and text[end] in _JSON_WHITESPACE:
            end += 1
        self._whitespace_ends[position] = end
        return end

    def find(self, needle: str, start: int) -> int:
        """str.find, past what an earlier search from `start` has seen."""
        key = (needle, start)
        found = self.text.find(needle, self._searched.get(key, start))
        # Not found: a tail shorter than the needle may still begin it.
        self._searched[key] = found if found >= 0 else max(start, len(self.text) - len(needle) + 1)
        return found

    def string_end(self, start: int) -> int | None:
        """The index after the JSON string opening at `start`; None where none opens there or it is
        unfinished."""
        text = self.text
        if start >= len(text) or text[start] != '"':
            return None
        position, finished = self._strings.get(start, (start + 1, False))
        while not finished and position < len(text):
            character = text[position]
            if character == "\\":
                position += 2
            else:
                position += 1
                finished = character == '"'
        self._strings[start] = (position, finished)
        return position if finished else None

    def object_end(self, start: int) -> int | None:
        """The index after the JSON object opening at `start`, found by matching brackets outside strings;
        None while it is unfinished."""
        text = self.text
        position, depth, in_string, finished = self._objects.get(start, (start, 0, False, False))
        while not finished and position < len(text):
            character = text[position]
            position += 1
            if in_string:
                if character == "\\":
                    position += 1
                elif character == '"':
                    in_string = False
            elif character == '"':
                in_string = True
            elif character in "{[":
                depth += 1
            elif character in "}]":
                depth -= 1
                finished = depth == 0
        self._objects[start] = (position, depth, in_string, finished)
        return position if finished else None


class OutputReader(ABC):
    """Reads one output as it grows: `read` after each delta. What is settled (calls closed, the content
    before them) stays read; the rest is read again from where it begins, with scans that go on from where
    they stopped. A second call where parallel calls are not allowed makes the whole output content."""

    def __init__(self, function_names: Collection[str], parallel: bool = True) -> None:
        self.function_names = function_names
        self.parallel = parallel
        self.output = GrowingText()
        self.reading = OutputReading()
        # Where the unsettled rest begins, and how many of the reading's calls and content spans are settled.
        self._position = self._initial_position()
        self._settled = (0, 0)

    @property
    def text(self) -> str:
        return self.output.text

    def read(self, delta: str) -> OutputReading:
        """The calls and content of the output so far, `delta` added; the same reading each time, updated."""
        self.output.extend(delta)
        reading = self.reading
        if reading.malformed:  # more text cannot mend it
            return reading
        calls, spans = self._settled
        del reading.calls[calls:], reading.content_spans[spans:]
        reading.inside_call = False
        self._read_rest(self._position)
        reading.malformed |= not self.parallel and len(reading.calls) > 1
        return reading

    def _initial_position(self) -> int:
        return 0

    def _next_call_start(self, position: int, separator: str) -> int:
        """Where the next call may begin from `position`: past whitespace, and after a call, past one
        separator and the whitespace after it."""
        output = self.output
        position = output.skip_whitespace(position)
        if self.reading.calls and output.text.startswith(separator, position):
            position = output.skip_whitespace(position + 1)
        return position

    def _settle(self, position: int) -> None:
        """Everything before `position` is read for good."""
        self._position = position
        self._settled = (len(self.reading.calls), len(self.reading.content_spans))

    @abstractmethod
    def _read_rest(self, position: int) -> None:
        """Reads the output from `position` (where the settled part ends) into the reading."""


class HermesToolCallParser(OutputReader):
    START, END = "<tool_call>", "</tool_call>"

    def _read_rest(self, position: int) -> None:
        output, reading = self.output, self.reading
        text = output.text
        reading.content_end = self._content_end()
        while True:
            start = output.find(self.START, position)
            if start < 0:
                reading.content_spans.append((position, len(text)))
                return
            reading.content_spans.append((position, start))
            call = _read_call(
                output, output.skip_whitespace(start + len(self.START)), ("arguments",), self.function_names
            )
            if call is None:
                reading.malformed = True
                return
            reading.calls.append(call)
            after = len(text) if call.end is None else output.skip_whitespace(call.end)
            if not text.startswith(self.END, after):
                reading.inside_call = self.END.startswith(text[after:])
                reading.malformed = not reading.inside_call
                return
            position = after + len(self.END)
            self._settle(position)

    def _content_end(self) -> int:
        """Content may be streamed up to the first call, and short of a tail that may begin one."""
        start = self.output.find(self.START, 0)
        if start >= 0:
            return start
        text = self.output.text
        for length in range(min(len(self.START) - 1, len(text)), 0, -1):
            if text.endswith(self.START[:length]):
                return len(text) - length
        return len(text)


class Llama3JsonToolCallParser(OutputReader):
    def _read_rest(self, position: int) -> None:
        output, reading = self.output, self.reading
        text = output.text
        while True:
            # Calls are separated by ";" (or only by whitespace).
            position = self._next_call_start(position, ";")
            if position == len(text):
                return
            if text[position] != "{":
                reading.malformed = True
                return
            # Llama's format names the arguments "parameters"; some of its fine-tunes write "arguments".
            call = _read_call(output, position, ("parameters", "arguments"), self.function_names)
            if call is None:
                reading.malformed = True
                return
            reading.calls.append(call)
            if call.end is None:
                reading.inside_call = True
                return
            position = call.end
            self._settle(position)


class _CallArrayReader(OutputReader):
    """tool_choice `required`: the grammar writes `[call, call, ...]`."""

    def _initial_position(self) -> int:
        return 1  # past the "["

    def _read_rest(self, position: int) -> None:
        output, reading = self.output, self.reading
        text = output.text
        while True:
            position = self._next_call_start(position, ",")
            if position >= len(text) or text[position] == "]":
                break
            call = _read_call(output, position, ("parameters",), self.function_names)
            assert call is not None, "the grammar only lets calls through"
            reading.calls.append(call)
            if call.end is None:
                break
            position = call.end
            self._settle(position)
        reading.inside_call = not text.endswith("]")


class _ArgumentsReader(OutputReader):
    """A named function: the whole output is its arguments."""

    def _read_rest(self, position: int) -> None:
        (name,) = self.function_names
        length = len(self.output.text)
        self.reading.calls.append(CallReading(0, name, 0, length, length))


TOOL_CALL_PARSERS: dict[str, type[OutputReader]] = {
    "hermes": HermesToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
}


class ToolCalling:
    """One request's tool_choice: the constraint it puts on the output, and how calls are read from it."""

    def __init__(
        self, mode: str, tools: list[Tool], parser: type[OutputReader] | None, parallel: bool
    ) -> None:
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
            return cls("auto", tools, TOOL_CALL_PARSERS[parser_name], body.parallel_tool_calls)
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

    def reader(self) -> OutputReader:
        """A reader for one output (one choice), to feed its deltas as they come."""
        if self.parser is not None:
            return self.parser(self.tools, self.parallel)
        if self.mode == "required":
            return _CallArrayReader(self.tools)
        return _ArgumentsReader({self.mode})

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of an output that finished with "stop". A constrained output that did not finish
        (a stop string) is not JSON, and stays content."""
        return self.reader().read(text).parsed(text)

    def _parameters(self, name: str) -> dict[str, Any]:
        parameters = self.tools[name].function.parameters
        return parameters if parameters is not None else _NO_PARAMETERS


def _read_call(
    output: GrowingText, start: int, arguments_keys: tuple[str, ...], function_names: Collection[str]
) -> CallReading | None:
    """Reads `{"name": ..., "<one of arguments_keys>": {...}}` (members in either order) from `start`, as far
    as the text goes; None where it strays from that shape: other members, a function not among
    `function_names`, arguments that are not an object. The arguments' brackets are matched, not checked:
    finished outputs are parsed whole (OutputReading.parsed)."""
    text = output.text
    call = CallReading(start)
    if start == len(text):
        return call
    if text[start] != "{":
        return None
    position = start + 1
    first = True
    while True:
        position = output.skip_whitespace(position)
        if position == len(text):
            return call
        if text[position] == "}" and call.name is not None and call.arguments_end is not None:
            call.end = position + 1
            return call
        if not first:
            if text[position] != ",":
                return None
            position = output.skip_whitespace(position + 1)
            if position == len(text):
                return call
        first = False
        key_end = output.string_end(position)
        if key_end is None:
            return call if position < len(text) and text[position] == '"' else None
        key = _string_value(text[position:key_end])
        position = output.skip_whitespace(key_end)
        if position == len(text):
            return call
        if text[position] != ":":
            return None
        position = output.skip_whitespace(position + 1)
        if position == len(text):
            return call
        if key == "name" and call.name is None:
            name_end = output.string_end(position)
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
            call.arguments_end = output.object_end(position)
            if call.arguments_end is None:
                return call
            position = call.arguments_end
        else:
            return None


def _string_value(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None
