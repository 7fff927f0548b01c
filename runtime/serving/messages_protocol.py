"""The request bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as vLLM
serves it), and their translation into the chat completion request the chat path runs: the system prompt
becomes a system message, content blocks become content parts, `tool_use` blocks an assistant turn's calls,
`tool_result` blocks tool messages, tools and tool_choice their chat forms.

A conversation that ends with an assistant message is continued from that message's text (Anthropic's
prefill): the answer goes on with it, as chat's `continue_final_message` does. Earlier turns' thinking blocks
are left out of the prompt, as Anthropic's API leaves them out of the context.

Thinking `enabled` with its `budget_tokens` is vLLM's thinking_token_budget (served where the engine has a
reasoning parser), `disabled` switches the chat template's thinking off, `adaptive` leaves it to the model.
What would change the answer but is not served is refused by name (400): server tools, and block types other
than text, image, tool_use, tool_result and thinking.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime.serving.errors import validation_error
from kvfleet.runtime.serving.protocol import Body, ChatCompletionRequest, FiniteFloat, RequestBody
from pydantic import ConfigDict, Field, StrictBool, StrictInt, ValidationError

# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024
# Anthropic's reasoning efforts, which chat's reasoning_effort takes as they are.
Effort = Literal["low", "medium", "high", "xhigh", "max"]


class ContentBlock(Body):
    """A block of a message's content, of the system prompt, or of a tool result's content."""

    type: str
    text: str | None = None
    # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"} (read by _image_part).
    source: dict[str, Any] | None = None
    # tool_use: the call's id, the tool's name and its input.
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result: the call answered, and the answer (text, or text and image blocks).
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: StrictBool | None = None


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Body):
    # Absent or "custom" for a client tool; Anthropic's server tools name their kind here.
    type: str | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    strict: StrictBool | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None


class OutputFormat(Body):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    # Aliased: `schema` is a BaseModel method.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    effort: Effort | None = None
    format: OutputFormat | None = None


class CountTokensRequest(RequestBody):
    """What a conversation is: the body of /v1/messages/count_tokens, and the part of /v1/messages' that the
    prompt is rendered from."""

    model: str | None = None
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # vLLM's: variables the chat template reads beyond the messages (Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self.refuse_unsupported()
        if not self.messages:
            raise BadRequestError("messages must not be empty", param="messages")
        thinking = self.thinking
        if (
            thinking is not None
            and thinking.type == "enabled"
            and (thinking.budget_tokens or 0) < MIN_THINKING_BUDGET
        ):
            raise BadRequestError(
                f"thinking of type enabled needs budget_tokens of at least {MIN_THINKING_BUDGET}",
                param="thinking.budget_tokens",
            )
        names = set()
        for index, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise BadRequestError(
                    f"tools are client tools (type custom, or none); server tool {tool.type!r} is not served",
                    param=f"tools.{index}.type",
                )
            names.add(tool.name)
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise BadRequestError(
                f"tool_choice names {choice.name!r}, which is not one of the tools", param="tool_choice.name"
            )

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request's fields that say what the conversation is."""
        system = _system_text(self.system)
        messages = [{"role": "system", "content": system}] if system else []
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages.{index}")
        last = self.messages[-1]
        # Anthropic's prefill: the answer goes on with a final assistant message's text.
        prefilled = last.role == "assistant" and not messages[-1].get("tool_calls")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": not prefilled,
            "continue_final_message": prefilled,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                        "strict": tool.strict,
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            )
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        output = self.output_config
        if output is not None and output.format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output.format.json_schema},
            }
        if self.thinking is not None and self.thinking.type == "enabled":
            body["thinking_token_budget"] = self.thinking.budget_tokens
        if self.thinking is not None and self.thinking.type == "disabled":
            body["reasoning_effort"] = "none"
        elif output is not None and output.effort is not None:
            body["reasoning_effort"] = output.effort
        return body

    def chat_request(self) -> ChatCompletionRequest:
        return _validated(self.chat_body())


class MessagesRequest(CountTokensRequest):
    """The body of POST /v1/messages."""

    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    # Anthropic's, about the caller (an opaque user id): nothing here reads it.
    metadata: dict[str, Any] | None = None
    # vLLM's, as on chat: a tenant's salt; its prompts share prefix-cache blocks only with the same salt's.
    cache_salt: str | None = None
    # kvfleet's, as on the other routes: an SLA tier name or its integer, and a deadline in seconds.
    priority: StrictInt | str | None = None
    timeout: Annotated[FiniteFloat, Field(gt=0)] | None = None

    def check(self) -> None:
        super().check()
        thinking = self.thinking
        enabled = thinking is not None and thinking.type == "enabled"
        if enabled and thinking.budget_tokens is not None and thinking.budget_tokens >= self.max_tokens:
            raise BadRequestError(
                "thinking.budget_tokens must be less than max_tokens, which counts the thinking too",
                param="thinking.budget_tokens",
            )

    def chat_request(self) -> ChatCompletionRequest:
        body = {
            **self.chat_body(),
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "timeout": self.timeout,
        }
        if self.stream:
            # The usage the last events carry.
            body["stream_options"] = {"include_usage": True}
        return _validated(body)


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    for index, block in enumerate(system):
        if block.type != "text":
            raise BadRequestError(f"system blocks are text; got {block.type!r}", param=f"system.{index}")
    return "".join(block.text or "" for block in system)


def _chat_messages(message: Message, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user message's tool results come first, each a tool
    message (its images then in a user message of their own), then the rest of its content."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(message.content):
        where = f"{param}.content.{index}"
        if block.type == "text":
            parts.append({"type": "text", "text": block.text or ""})
        elif block.type == "image":
            parts.append(_image_part(block, where))
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier turns' thinking is not part of the context
        elif block.type == "tool_use" and message.role == "assistant":
            if block.id is None or block.name is None:
                raise BadRequestError("a tool_use block needs its id and name", param=where)
            arguments = json.dumps(block.input or {})
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif block.type == "tool_result" and message.role == "user":
            messages += _tool_result(block, where)
        else:
            raise BadRequestError(
                f"a {message.role} message's blocks are text, image"
                + (", thinking or tool_use" if message.role == "assistant" else " or tool_result")
                + f"; got {block.type!r}",
                param=where,
            )
    if calls:
        text = "".join(part["text"] for part in parts if part["type"] == "text")
        messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif parts or not messages:
        # One text block is the message's text, as vLLM reads it (templates that take a string get it so).
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        messages.append({"role": message.role, "content": parts[0]["text"] if one_text else parts})
    return messages


def _tool_result(block: ContentBlock, param: str) -> list[dict[str, Any]]:
    if block.tool_use_id is None:
        raise BadRequestError("a tool_result block needs the tool_use_id it answers", param=param)
    content = block.content
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    for index, part in enumerate(content if isinstance(content, list) else []):
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type == "image":
            images.append(_image_part(part, f"{param}.content.{index}"))
        else:
            raise BadRequestError(
                f"a tool result's blocks are text or image; got {part.type!r}",
                param=f"{param}.content.{index}",
            )
    messages: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": block.tool_use_id, "content": "\n".join(texts)}
    ]
    if images:
        messages.append({"role": "user", "content": images})
    return messages


def _image_part(block: ContentBlock, param: str) -> dict[str, Any]:
    source = block.source or {}
    kind, where = source.get("type"), f"{param}.source"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    media_type, data = source.get("media_type"), source.get("data")
    if kind == "base64" and isinstance(media_type, str) and isinstance(data, str) and media_type and data:
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    raise BadRequestError(
        "an image's source is {type: base64, media_type, data} or {type: url, url}", param=where
    )
