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
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.server.errors import BadRequestError
from kvfleet.runtime.server.protocol import ChatCompletionRequest, Tool

# A function without parameters takes an empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    # The arguments as JSON text.
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


class ToolCallParser(ABC):
    """Reads calls written by the model among free text."""

    def __init__(self, function_names: set[str]) -> None:
        self.function_names = function_names

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); the text whole as content, and no calls, when any call is malformed."""

    @abstractmethod
    def streamable(self, text: str) -> int:
        """How much of an unfinished output can be streamed as content: what follows may be a call."""

    def _call(self, value: Any, arguments_key: str) -> ParsedCall | None:
        if not isinstance(value, dict) or set(value) != {"name", arguments_key}:
            return None
        name, arguments = value["name"], value[arguments_key]
        if name not in self.function_names or not isinstance(arguments, dict):
            return None
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class HermesToolCallParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = self._call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = self._BLOCK.sub("", text)
        if self.START in content:  # a call left open
            return text, []
        # Not stripped: what came before the first call may have been streamed already, as it is.
        return (content if content.strip() else None), calls

    def streamable(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        for length in range(min(len(self.START) - 1, len(text)), 0, -1):
            if text.endswith(self.START[:length]):
                return len(text) - length
        return len(text)


class Llama3JsonToolCallParser(ToolCallParser):
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        decoder = json.JSONDecoder()
        stripped = text.strip()
        position = 0
        calls = []
        while position < len(stripped):
            try:
                value, position = decoder.raw_decode(stripped, position)
            except json.JSONDecodeError:
                return text, []
            # Llama's format names the arguments "parameters"; some of its fine-tunes write "arguments".
            call = self._call(value, "parameters") or self._call(value, "arguments")
            if call is None:
                return text, []
            calls.append(call)
            rest = stripped[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            position = len(stripped) - len(rest)
        return (None, calls) if calls else (text, [])

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)


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

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output. A constrained output that did not finish (max_tokens) is
        not JSON, and stays content."""
        if self.parser is not None:
            content, calls = self.parser.parse(text)
            if not self.parallel and len(calls) > 1:
                return text, []
            return content, calls
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if self.mode == "required":
            return None, [
                ParsedCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value
            ]
        return None, [ParsedCall(self.mode, text)]

    def streamable(self, text: str) -> int:
        """How much of an unfinished output may be streamed as content now."""
        return 0 if self.parser is None else self.parser.streamable(text)

    def _parameters(self, name: str) -> dict[str, Any]:
        parameters = self.tools[name].function.parameters
        return parameters if parameters is not None else _NO_PARAMETERS
