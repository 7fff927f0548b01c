"""The request body of POST /v1/responses (OpenAI's Responses API), and its translation into the chat
completion request the chat path runs: the input items become messages, function tools become chat tools,
`text.format` becomes `response_format`.

What would change the answer but is not served is refused by name (400): background runs, tools other than
functions, `include`, reasoning settings, input files.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime.serving.errors import validation_error
from kvfleet.runtime.serving.protocol import Body, ChatCompletionRequest, FiniteFloat, RequestBody, RequestId
from pydantic import ConfigDict, Field, StrictBool, StrictInt, ValidationError


class InputContentPart(Body):
    """A part of an input message's content: text the client or the model wrote, or an image."""

    type: Literal["input_text", "output_text", "input_image", "input_file", "refusal"]
    text: str | None = None
    image_url: str | None = None
    detail: str | None = None
    refusal: str | None = None


class InputItem(Body):
    """One item of `input`: a message (with or without type "message"), a function call the model made, or
    a function call's output."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContentPart] | None = None
    # function_call and function_call_output items.
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(Body):
    type: str
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # Aliased: `schema` is a BaseModel method.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    stream: StrictBool = False
    # OpenAI's default: stored, where the server keeps responses (--max-stored-responses).
    store: StrictBool = True
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused unless they leave the answer as it is.
    background: StrictBool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # vLLM's, as on chat: a tenant's salt; its prompts share prefix-cache blocks only with the same salt's.
    cache_salt: str | None = None
    # vLLM's: the response's id as it is (one the server does not already keep).
    request_id: RequestId | None = None
    # kvfleet's, as on the other routes: an SLA tier name or its integer, and a deadline in seconds.
    priority: StrictInt | str | None = None
    timeout: Annotated[FiniteFloat, Field(gt=0)] | None = None

    def check(self) -> None:
        self.refuse_unsupported()
        if self.background:
            raise BadRequestError("background responses are not supported", param="background")
        if self.include:
            raise BadRequestError(f"include {self.include[0]!r} is not supported", param="include")
        if self.reasoning:
            raise BadRequestError("reasoning settings are not supported", param="reasoning")
        for index, tool in enumerate(self.tools or []):
            if tool.type != "function" or tool.name is None:
                raise BadRequestError(
                    f"tools are functions (type function, with a name); got type {tool.type!r}",
                    param=f"tools.{index}",
                )

    def chat_request(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request that answers this one: the instructions, then `conversation` (the
        stored one `previous_response_id` continues, and the input, as chat messages)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += conversation
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "priority": self.priority,
            "timeout": self.timeout,
            "cache_salt": self.cache_salt,
            "request_id": self.request_id,
        }
        if self.stream:
            # The usage the last event carries.
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        response_format = self._response_format()
        if response_format is not None:
            body["response_format"] = response_format
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: consecutive function calls are one assistant turn's calls."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise BadRequestError("input must not be empty", param="input")
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            param = f"input.{index}"
            if item.type == "message":
                messages.append(_message(item, param))
            elif item.type == "function_call":
                if item.call_id is None or item.name is None or item.arguments is None:
                    raise BadRequestError("a function_call needs call_id, name and arguments", param=param)
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                previous = messages[-1] if messages else None
                if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls"):
                    previous["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                if item.call_id is None or item.output is None:
                    raise BadRequestError("a function_call_output needs call_id and output", param=param)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                raise BadRequestError(
                    f"input items are messages, function_call or function_call_output; got {item.type!r}",
                    param=param,
                )
        return messages

    def _response_format(self) -> dict[str, Any] | None:
        text_format = self.text.format if self.text is not None else None
        if text_format is None or text_format.type == "text":
            return None
        if text_format.type == "json_object":
            return {"type": "json_object"}
        if text_format.json_schema is None:
            raise BadRequestError("a json_schema text format needs its schema", param="text.format.schema")
        return {
            "type": "json_schema",
            "json_schema": {
                "name": text_format.name or "response",
                "schema": text_format.json_schema,
                "strict": text_format.strict,
            },
        }

    def text_config(self) -> dict[str, Any]:
        """`text` as the response echoes it."""
        if self.text is None or self.text.format is None:
            return {"format": {"type": "text"}}
        return {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}


def _message(item: InputItem, param: str) -> dict[str, Any]:
    if item.role is None:
        raise BadRequestError("a message needs its role", param=f"{param}.role")
    content = item.content
    if content is None or isinstance(content, str):
        return {"role": item.role, "content": content or ""}
    parts: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        if part.type in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.text or ""})
        elif part.type == "refusal":
            parts.append({"type": "text", "text": part.refusal or ""})
        elif part.type == "input_image" and part.image_url is not None:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}})
        else:
            raise BadRequestError(
                "content parts are input_text, output_text, refusal or input_image (by URL); got "
                f"{part.type!r}",
                param=f"{param}.content.{number}",
            )
    return {"role": item.role, "content": parts}
