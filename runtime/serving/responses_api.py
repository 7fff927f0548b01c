"""POST /v1/responses (OpenAI's Responses API) over the chat path: the request becomes a chat completion
request, admitted and run like any other, and the chat answer (or its chunks) becomes a response (or its
typed events: response.created, response.output_text.delta, response.completed, ...). With a reasoning
parser, the model's reasoning comes first, as a reasoning item (response.reasoning_text.delta events).

Responses are kept for `previous_response_id` and GET /v1/responses/{id} only where the server keeps a
store (--max-stored-responses); without one, as vLLM serves by default, `store` is answered false and
`previous_response_id` is refused.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    BadRequestError,
    ConflictError,
    NotFoundError,
    OpenAIError,
)
from kvfleet.runtime.serving.chat import ChatRoute
from kvfleet.runtime.serving.protocol import ChatCompletionRequest, ChatMessage
from kvfleet.runtime.serving.request import PreparedRequest, Prompt, RequestHeaders
from kvfleet.runtime.serving.response_store import ResponseStore, StoredResponse
from kvfleet.runtime.serving.responses_protocol import NamedFunctionChoice, ResponsesRequest
from kvfleet.runtime.serving.streams import chat_stream_events

if TYPE_CHECKING:
    from kvfleet.runtime.serving.safety import RequestSafety
    from kvfleet.runtime.serving.service import OpenAIService, ServiceSettings

# How a chat answer's finish reason reads in a response: its status, and why it is incomplete.
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}
# A failed response's error code (OpenAI's are few) by the HTTP status of its error; others: server_error.
_FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


class _ResponsesChatRoute(ChatRoute):
    id_prefix = "resp"
    keeps_request_id = True
    reports_cached_tokens = True

    def __init__(self, body: ChatCompletionRequest, settings: ServiceSettings, drops_turns: bool) -> None:
        super().__init__(body, settings)
        self.drops_turns = drops_turns

    async def prompt(self, service: OpenAIService, safety: RequestSafety | None) -> Prompt:
        """With truncation "auto" (OpenAI's), a conversation longer than the context loses its oldest turns
        (a user message and what follows it), the fewest that leave room for the output; the instructions and
        the last turn stay. vLLM cuts the prompt's tokens instead, which can cut a message, or the template's
        markup, in two."""
        if not self.drops_turns:
            return await super().prompt(service, safety)
        whole = self.body
        head, turns = _turns(whole.messages)
        room = service.engine_info.max_model_len - (whole.max_tokens or 1)
        dropped = 0
        while True:
            self.body = whole.model_copy(update={"messages": _kept(head, turns, dropped)})
            last = dropped == len(turns) - 1
            try:
                prompt = await super().prompt(service, safety)
            except BadRequestError as error:
                if last or error.code != CONTEXT_LENGTH_EXCEEDED:
                    raise
            else:
                # Media are counted here: the search below renders their placeholders alone.
                if last or len(prompt.token_ids[0]) <= room:
                    return prompt
            dropped = await self._fewest_dropped(service, head, turns, room, dropped + 1)

    async def _fewest_dropped(
        self,
        service: OpenAIService,
        head: list[ChatMessage],
        turns: list[list[ChatMessage]],
        room: int,
        low: int,
    ) -> int:
        """The fewest oldest turns, at least `low`, whose dropping leaves a rendered prompt within `room`
        tokens (all but the last where none does): a binary search, a prompt being shorter for each turn
        less."""
        high = len(turns) - 1
        while low < high:
            middle = (low + high) // 2
            try:
                fits = len(await self.render(service, _kept(head, turns, middle))) <= room
            except BadRequestError as error:
                if error.code != CONTEXT_LENGTH_EXCEEDED:
                    raise
                fits = False
            if fits:
                high = middle
            else:
                low = middle + 1
        return low


def _turns(messages: list[ChatMessage]) -> tuple[list[ChatMessage], list[list[ChatMessage]]]:
    """The leading system and developer messages (the instructions), and the turns after them: each from a
    user message to the next (the first from whatever comes first)."""
    start = 0
    while start < len(messages) and messages[start].role in ("system", "developer"):
        start += 1
    turns: list[list[ChatMessage]] = []
    for message in messages[start:]:
        if not turns or message.role == "user":
            turns.append([])
        turns[-1].append(message)
    return messages[:start], turns


def _kept(head: list[ChatMessage], turns: list[list[ChatMessage]], dropped: int) -> list[ChatMessage]:
    return [*head, *(message for turn in turns[dropped:] for message in turn)]


@dataclass
class PreparedResponse:
    """An admitted Responses request: its body, the chat request running it, and the conversation the
    store keeps with its output."""

    body: ResponsesRequest
    request: PreparedRequest
    conversation: list[dict[str, Any]]
    stored: bool

    @property
    def response_id(self) -> str:
        return self.request.request_id


class OpenAIServingResponses:
    def __init__(self, service: OpenAIService, store: ResponseStore | None) -> None:
        self.service = service
        self.store = store

    async def create(self, body: ResponsesRequest, headers: RequestHeaders) -> PreparedResponse:
        """Every check of the request, then its admission as a chat request."""
        body.check()
        if body.request_id is not None and self.store is not None and body.request_id in self.store:
            raise ConflictError(f"a stored response has the id {body.request_id!r}", param="request_id")
        conversation = self._history(body.previous_response_id) + body.input_messages()
        route = _ResponsesChatRoute(
            body.chat_request(conversation), self.service.settings, drops_turns=body.truncation == "auto"
        )
        request = await self.service.admit(route, headers)
        return PreparedResponse(body, request, conversation, stored=body.store and self.store is not None)

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        if self.store is None:
            raise BadRequestError(
                "previous_response_id needs a server that keeps responses (--max-stored-responses); send "
                "the whole conversation as input instead",
                param="previous_response_id",
            )
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise NotFoundError(
                f"no stored response has the id {previous_response_id!r}", param="previous_response_id"
            )
        return list(stored.messages)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        assert self.store is not None, "served with a store only"
        stored = self.store.get(response_id)
        if stored is None:
            raise NotFoundError(f"no stored response has the id {response_id!r}", param="response_id")
        return stored.body

    def delete(self, response_id: str) -> dict[str, Any]:
        assert self.store is not None, "served with a store only"
        if not self.store.delete(response_id):
            raise NotFoundError(f"no stored response has the id {response_id!r}", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def complete(self, prepared: PreparedResponse) -> dict[str, Any]:
        """Runs the request to its end: the response."""
        chat = await self.service.complete(prepared.request)
        (choice,) = chat["choices"]
        message = choice["message"]
        calls = [
            _call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls") or []
        ]
        text = message["content"]
        output = [_message_item(text or ""), *calls] if text or not calls else calls
        if message.get("reasoning_content"):
            output.insert(0, _reasoning_item(message["reasoning_content"]))
        usage = chat["usage"]
        response = _response(prepared, output, choice["finish_reason"], usage)
        self._keep(prepared, response)
        return response

    async def stream(self, prepared: PreparedResponse) -> AsyncIterator[dict[str, Any]]:
        """The chat chunks that answer the response, returned once its first output is in (as the chat
        stream is); `events` turns them into the response's events."""
        return await self.service.stream(prepared.request)

    async def events(
        self, prepared: PreparedResponse, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The response's events, from its created event to its completed one; a failure, even one raised at
        the first chunk, is an error event and the response failed."""
        events = _ResponseEvents(prepared)
        for event in events.start():
            yield event

        def finish() -> list[dict[str, Any]]:
            finished = events.finish()
            self._keep(prepared, finished[-1]["response"])
            return finished

        async for event in chat_stream_events(chunks, events.read, events.fail, finish):
            yield event

    def _keep(self, prepared: PreparedResponse, response: dict[str, Any]) -> None:
        if self.store is None or not prepared.stored:
            return
        self.store.put(
            prepared.response_id,
            StoredResponse(body=response, messages=[*prepared.conversation, _assistant_turn(response)]),
        )


def _response(
    prepared: PreparedResponse,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    *,
    status: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response body: `status` given while it runs or once it has failed, else read from the finish
    reason."""
    body, request = prepared.body, prepared.request
    incomplete_reason = _INCOMPLETE_REASONS.get(finish_reason or "")
    if status is None:
        status = "incomplete" if incomplete_reason else "completed"
    tool_choice = body.tool_choice
    return {
        "id": prepared.response_id,
        "object": "response",
        "created_at": request.created,
        "model": request.model,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": request.params.temperature,
        "top_p": request.params.top_p,
        "tool_choice": tool_choice.model_dump()
        if isinstance(tool_choice, NamedFunctionChoice)
        else tool_choice or "auto",
        "tools": [tool.model_dump() for tool in body.tools or []],
        "text": body.text_config(),
        "truncation": body.truncation or "disabled",
        "store": prepared.stored,
        "background": False,
        "usage": _usage(usage) if usage is not None else None,
        "user": body.user,
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)] if status == "completed" else [],
    }


def _reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "status": status,
        "content": [_reasoning_part(text)] if status == "completed" else [],
    }


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _assistant_turn(response: dict[str, Any]) -> dict[str, Any]:
    """A response's output as the assistant's chat message, for the conversation a follow-up continues."""
    text = "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in response["output"]
        if item["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return turn


@dataclass
class _OpenText:
    output_index: int
    item_id: str
    text: str = ""


@dataclass
class _OpenCall:
    output_index: int
    item_id: str
    call_id: str
    name: str
    arguments: str = ""


class _ResponseEvents:
    """A chat stream's chunks as the Responses API's events: each run of content is a message item, each
    call a function_call item; every item is added, filled by deltas and done, in order of its output
    index, and the last event carries the whole response."""

    def __init__(self, prepared: PreparedResponse) -> None:
        self.prepared = prepared
        self.sequence_number = 0
        # Finished items by output index; the open ones are kept apart until they are done.
        self.output: dict[int, dict[str, Any]] = {}
        self.text: _OpenText | None = None
        self.reasoning: _OpenText | None = None
        self.calls: dict[int, _OpenCall] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, event_type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _next_index(self) -> int:
        return len(self.output) + (self.reasoning is not None) + (self.text is not None) + len(self.calls)

    def start(self) -> list[dict[str, Any]]:
        running = _response(self.prepared, [], None, None, status="in_progress")
        return [
            self._event("response.created", response=running),
            self._event("response.in_progress", response=running),
        ]

    def read(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                events += self._reasoning_delta(delta["reasoning_content"])
            if delta.get("content") or delta.get("tool_calls"):
                events += self._close_reasoning()
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _reasoning_delta(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.reasoning is None:
            self.reasoning = _OpenText(self._next_index(), f"rs_{uuid.uuid4().hex}")
            where = {"output_index": self.reasoning.output_index}
            item = _reasoning_item("", "in_progress", self.reasoning.item_id)
            events += [
                self._event("response.output_item.added", item=item, **where),
                self._event(
                    "response.content_part.added",
                    item_id=self.reasoning.item_id,
                    content_index=0,
                    part=_reasoning_part(""),
                    **where,
                ),
            ]
        self.reasoning.text += delta
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=self.reasoning.item_id,
                output_index=self.reasoning.output_index,
                content_index=0,
                delta=delta,
            )
        )
        return events

    def _close_reasoning(self) -> list[dict[str, Any]]:
        reasoning = self.reasoning
        if reasoning is None:
            return []
        self.reasoning = None
        item = _reasoning_item(reasoning.text, "completed", reasoning.item_id)
        self.output[reasoning.output_index] = item
        where = {"item_id": reasoning.item_id, "output_index": reasoning.output_index, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", text=reasoning.text, **where),
            self._event("response.content_part.done", part=_reasoning_part(reasoning.text), **where),
            self._event("response.output_item.done", output_index=reasoning.output_index, item=item),
        ]

    def _text_delta(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.text is None:
            events += self._open_text()
        assert self.text is not None
        self.text.text += delta
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.text.item_id,
                output_index=self.text.output_index,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def _open_text(self) -> list[dict[str, Any]]:
        self.text = _OpenText(self._next_index(), f"msg_{uuid.uuid4().hex}")
        where = {"output_index": self.text.output_index}
        return [
            self._event(
                "response.output_item.added",
                item=_message_item("", "in_progress", self.text.item_id),
                **where,
            ),
            self._event(
                "response.content_part.added",
                item_id=self.text.item_id,
                content_index=0,
                part=_text_part(""),
                **where,
            ),
        ]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = call.get("function") or {}
        if "id" in call:  # a call announced: what came before it as content is done
            events += self._close_text()
            opened = _OpenCall(self._next_index(), f"fc_{uuid.uuid4().hex}", call["id"], function["name"])
            self.calls[call["index"]] = opened
            item = _call_item(opened.call_id, opened.name, "", "in_progress", opened.item_id)
            events.append(
                self._event("response.output_item.added", output_index=opened.output_index, item=item)
            )
        arguments = function.get("arguments")
        if arguments:
            opened = self.calls[call["index"]]
            opened.arguments += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=opened.item_id,
                    output_index=opened.output_index,
                    delta=arguments,
                )
            )
        return events

    def _close_text(self) -> list[dict[str, Any]]:
        text = self.text
        if text is None:
            return []
        self.text = None
        item = _message_item(text.text, "completed", text.item_id)
        self.output[text.output_index] = item
        where = {"item_id": text.item_id, "output_index": text.output_index, "content_index": 0}
        return [
            self._event("response.output_text.done", text=text.text, logprobs=[], **where),
            self._event("response.content_part.done", part=_text_part(text.text), **where),
            self._event("response.output_item.done", output_index=text.output_index, item=item),
        ]

    def _close_calls(self) -> list[dict[str, Any]]:
        events = []
        for opened in self.calls.values():
            item = _call_item(opened.call_id, opened.name, opened.arguments, "completed", opened.item_id)
            self.output[opened.output_index] = item
            where = {"item_id": opened.item_id, "output_index": opened.output_index}
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    name=opened.name,
                    arguments=opened.arguments,
                    **where,
                )
            )
            events.append(
                self._event("response.output_item.done", output_index=opened.output_index, item=item)
            )
        self.calls = {}
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The open items done, then response.completed (whose status may be incomplete, as vLLM's)."""
        events = self._close_reasoning()
        if not any(item["type"] != "reasoning" for item in self.output.values()) and not (
            self.text or self.calls
        ):
            events += self._open_text()  # an answer without text or calls is one empty message
        events += self._close_text() + self._close_calls()
        output = [self.output[index] for index in sorted(self.output)]
        response = _response(self.prepared, output, self.finish_reason, self.usage)
        events.append(self._event("response.completed", response=response))
        return events

    def fail(self, error: OpenAIError) -> list[dict[str, Any]]:
        """A failure mid-stream: OpenAI's error event (with kvfleet's code), then the response failed (with
        the code among OpenAI's few that fits)."""
        failed = _response(
            self.prepared,
            [self.output[index] for index in sorted(self.output)],
            None,
            self.usage,
            status="failed",
            error={"code": _FAILURE_CODES.get(error.status_code, "server_error"), "message": error.message},
        )
        return [
            self._event("error", **error.response_error()),
            self._event("response.failed", response=failed),
        ]
