"""POST /v1/messages (Anthropic's Messages API, as vLLM serves it) over the chat path: the request becomes a
chat completion request, admitted and run like any other, and the chat answer (or its chunks) becomes a
message (or its events: message_start, content_block_start, content_block_delta, content_block_stop,
message_delta, message_stop). With a reasoning parser the model's reasoning comes first, as a thinking block.
POST /v1/messages/count_tokens renders the same prompt and counts it.

A finish reads as Anthropic's stop reason: `max_tokens` for a length cut, `tool_use` when the model called
tools, `stop_sequence` (with the sequence) when one of `stop_sequences` ended it, `end_turn` otherwise.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import OpenAIError
from kvfleet.runtime.serving.chat import ChatRoute
from kvfleet.runtime.serving.messages_protocol import CountTokensRequest, MessagesRequest
from kvfleet.runtime.serving.request import PreparedRequest, RequestHeaders
from kvfleet.runtime.serving.streams import chat_stream_events

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService


class _MessagesChatRoute(ChatRoute):
    id_prefix = "msg"


@dataclass
class PreparedMessage:
    """An admitted Messages request: its body and the chat request running it."""

    body: MessagesRequest
    request: PreparedRequest


class AnthropicServingMessages:
    def __init__(self, service: OpenAIService) -> None:
        self.service = service

    async def create(self, body: MessagesRequest, headers: RequestHeaders) -> PreparedMessage:
        """Every check of the request, then its admission as a chat request."""
        body.check()
        route = _MessagesChatRoute(body.chat_request(), self.service.settings)
        return PreparedMessage(body, await self.service.admit(route, headers))

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        """The tokens of the prompt the conversation renders, its media's included."""
        body.check()
        self.service.check_model(body.model)
        route = _MessagesChatRoute(body.chat_request(), self.service.settings)
        prompt = await route.prompt(self.service, None)
        counted = len(prompt.token_ids[0])
        # Anthropic's context management (editing a conversation down) is not served: nothing was cut.
        return {"input_tokens": counted, "context_management": {"original_input_tokens": counted}}

    async def complete(self, prepared: PreparedMessage) -> dict[str, Any]:
        """Runs the request to its end: the message."""
        chat = await self.service.complete(prepared.request)
        (choice,) = chat["choices"]
        answer = choice["message"]
        content = []
        if answer.get("reasoning_content"):
            content.append(_thinking_block(answer["reasoning_content"]))
        calls = answer.get("tool_calls") or []
        if answer["content"] or not calls:
            content.append(_text_block(answer["content"] or ""))
        content += [
            _tool_use_block(call["id"], call["function"]["name"], _input(call["function"]["arguments"]))
            for call in calls
        ]
        stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice["stop_reason"], bool(calls))
        message = _message(prepared.request, content, stop_reason, stop_sequence)
        return {**message, "usage": _usage(chat["usage"])}

    async def stream(self, prepared: PreparedMessage) -> AsyncIterator[dict[str, Any]]:
        """The chat chunks that answer the message, returned once its first output is in (as the chat
        stream is); `events` turns them into the message's events."""
        return await self.service.stream(prepared.request)

    async def events(
        self, prepared: PreparedMessage, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The message's events, from message_start to message_stop; a failure mid-stream is an error event,
        and the stream ends there."""
        events = _MessageEvents(prepared.request)
        yield events.start()
        async for event in chat_stream_events(chunks, events.read, events.fail, events.finish):
            yield event


def _message(
    request: PreparedRequest,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
) -> dict[str, Any]:
    """A message; its stop_sequence only where one ended it (left out otherwise, as vLLM's)."""
    message = {
        "id": request.request_id,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": stop_reason,
    }
    return message if stop_sequence is None else {**message, "stop_sequence": stop_sequence}


def _stop_reason(
    finish_reason: str | None, stop_reason: int | str | None, called: bool
) -> tuple[str, str | None]:
    """Anthropic's stop reason and stop sequence for a chat answer's finish and stop reasons."""
    if finish_reason == "length":
        return "max_tokens", None
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str):  # the stop string that ended it (a stop token id is the model's end)
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat answer's usage as Anthropic counts it: the prompt tokens the prefix cache held are read from
    the cache, not input, where the server reports them (--enable-prompt-tokens-details, as vLLM's)."""
    details = usage.get("prompt_tokens_details")
    counts = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
    if details is not None:
        counts["input_tokens"] -= details["cached_tokens"]
        counts["cache_read_input_tokens"] = details["cached_tokens"]
    return counts


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input: the object they are (a call's arguments that are
    not an object, cut short by max_tokens say, are kept whole under "arguments")."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _thinking_block(thinking: str) -> dict[str, Any]:
    # No signature: nothing here signs the thinking (the SDK's block requires the field).
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use_block(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


class _MessageEvents:
    """A chat stream's chunks as the Messages API's events: each run of reasoning is a thinking block, each
    run of content a text block, each call a tool_use block whose input streams as JSON text; a block is
    started, filled by deltas and stopped before the next one starts, and message_delta carries the stop
    reason and the usage."""

    def __init__(self, request: PreparedRequest) -> None:
        self.request = request
        self.blocks = 0  # blocks started
        self.open: str | None = None  # the type of the block open now
        self.called = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: dict[str, Any] | None = None

    def start(self) -> dict[str, Any]:
        message = _message(self.request, [], None, None)
        prompt_tokens = sum(len(ids) for ids in self.request.prompt_token_ids)
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        return {"type": "message_start", "message": {**message, "usage": usage}}

    def read(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                events += self._delta(
                    "thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                )
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        return events

    def _delta(self, block_type: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if self.open != block_type:
            start = _thinking_block("") if block_type == "thinking" else _text_block("")
            events += self._start(block_type, start)
        events.append({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A call announced starts its tool_use block; its arguments follow as partial JSON (the calls before
        the last one announced are whole: chat streams them in order)."""
        events = []
        function = call.get("function") or {}
        if "id" in call:
            self.called = True
            events += self._start("tool_use", _tool_use_block(call["id"], function["name"], {}))
        if function.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})
        return events

    def _start(self, block_type: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        self.blocks += 1
        self.open = block_type
        return events

    def _stop(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def fail(self, error: OpenAIError) -> list[dict[str, Any]]:
        """A failure mid-stream: Anthropic's error event, which ends the stream."""
        return [error.anthropic_body()]

    def finish(self) -> list[dict[str, Any]]:
        """The open block stopped (an answer of nothing is one empty text block), then the stop reason and
        usage, then message_stop."""
        events = [] if self.blocks else self._start("text", _text_block(""))
        events += self._stop()
        stop_reason, stop_sequence = _stop_reason(self.finish_reason, self.stop_reason, self.called)
        usage = _usage(self.usage) if self.usage is not None else {"output_tokens": 0}
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage,
            }
        )
        events.append({"type": "message_stop"})
        return events
