"""POST /v1/chat/completions: the model folder's chat template turns the messages into one prompt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.safety.guardrails import Decision, redact_pieces
from kvfleet.runtime.server.media import load_chat_media
from kvfleet.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    message_text,
    template_messages,
    usage,
)
from kvfleet.runtime.server.safety import RequestSafety
from kvfleet.runtime.server.serving_base import Choice, OpenAIServing, PreparedRequest
from kvfleet.runtime.server.streaming import EventStreamResponse
from kvfleet.runtime.server.tool_calls import OutputReading, ParsedCall, ToolCalling, new_call_id
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class OpenAIServingChat(OpenAIServing):
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    async def create_chat_completion(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        lora_request = self.check_model(body.model)
        settings = self.state.settings
        tool_calling = ToolCalling.of(body, settings.tool_call_parser, settings.enable_auto_tool_choice)
        params = await self.sampling_params(body, tool_calling.constraint() if tool_calling else None)
        priority = self.resolve_priority(body.priority, raw_request)
        self.check_accepting(priority)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        messages = body.messages
        safety = self.request_safety(priority)
        if safety is not None:
            safety.prompt = _last_user_text(messages)
            if safety.redacts_input:
                messages = await _redacted(safety, messages)
        media = await load_chat_media(self.state.engine.config, messages)
        token_ids = await self.chat_prompt(messages, body.add_generation_prompt, tools)
        # Checked as the model reads it: the tools, the calls and all else the template puts in.
        rendered = await self.prompt_text(token_ids) if safety is not None else ""
        mm_features = []
        if media is not None:
            token_ids, mm_features = await media.expand(token_ids)
        self.check_prompt(token_ids, params, "messages")
        if safety is not None:
            if safety.redacts_input:
                await safety.refuse_unredacted(rendered)
            else:
                safety.start_input_check(rendered)
        request = self.prepare(
            [token_ids],
            params,
            priority=priority,
            timeout=body.timeout,
            arrival_time=arrival_time,
            lora_request=lora_request,
            safety=safety,
            mm_features=mm_features,
        )
        if body.stream:
            outputs = self.outputs(request, stream=True)
            first = await self.first_output(raw_request, outputs)
            return EventStreamResponse(self._events(body, request, outputs, first, tool_calling))
        choices = (await self.collect(raw_request, request))[0]
        return JSONResponse(self._response(body, request, choices, tool_calling))

    def _response(
        self,
        body: ChatCompletionRequest,
        request: PreparedRequest,
        choices: list[Choice],
        tool_calling: ToolCalling | None,
    ) -> dict:
        entries = []
        for index, choice in enumerate(choices):
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            finish_reason = choice.finish_reason
            calls = _calls(tool_calling, choice.text, finish_reason)
            if calls is not None:
                message["content"], parsed = calls
                message["tool_calls"] = [call.as_openai() for call in parsed]
                finish_reason = "tool_calls"
            entries.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self._logprobs(choice.token_ids, choice.logprobs, body.top_logprobs or 0),
                    "finish_reason": finish_reason,
                }
            )
        return {
            "id": request.request_id,
            "object": "chat.completion",
            "created": request.created,
            "model": request.model,
            "choices": entries,
            "usage": usage(
                len(request.prompt_token_ids[0]), sum(len(choice.token_ids) for choice in choices)
            ),
        }

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, limit: int
    ) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            text = self.token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": entry[token_id],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": top_text, "logprob": logprob, "bytes": list(top_text.encode())}
                        for top_text, logprob in self.top_logprobs(entry, limit)
                    ],
                }
            )
        return {"content": content}

    def _events(
        self,
        body: ChatCompletionRequest,
        request: PreparedRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        first: tuple[int, RequestOutput] | None,
        tool_calling: ToolCalling | None,
    ) -> AsyncIterator[str]:
        roles = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for index in range(request.params.n)
        ]

        def choice_of(_: int, completion: CompletionOutput, finished: bool) -> list[dict[str, Any]]:
            if not (completion.text or finished or completion.logprobs):
                return []
            return [
                {
                    "index": completion.index,
                    "delta": {"content": completion.text} if completion.text else {},
                    "logprobs": self._logprobs(
                        completion.token_ids, completion.logprobs, body.top_logprobs or 0
                    ),
                }
            ]

        builder = choice_of if tool_calling is None else _ToolCallStream(tool_calling, request.params.n)
        return self.event_stream(
            request, outputs, first, builder, include_usage=body.include_usage, preamble=roles
        )


def _last_user_text(messages: list[ChatMessage]) -> str | None:
    conversation = template_messages(messages)
    return next(
        (message_text(message) for message in reversed(conversation) if message["role"] == "user"), None
    )


async def _redacted(safety: RequestSafety, messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages with what the input checkers found redacted, each checked on its own."""
    texts = [message_text(message) for message in template_messages(messages)]
    decisions = await asyncio.gather(*(safety.checked_input(text) for text in texts))
    return [
        message if decision.text == text else _with_redactions(message, decision)
        for message, text, decision in zip(messages, texts, decisions, strict=True)
    ]


def _with_redactions(message: ChatMessage, decision: Decision) -> ChatMessage:
    """The message with its text redacted; with images or audio, each text part on its own, so that every
    part stays where the client put it."""
    if not isinstance(message.content, list):
        return message.model_copy(update={"content": decision.text})
    texts = [part.text for part in message.content if part.is_text]
    redacted = iter(redact_pieces(texts, decision.findings))
    content = [
        part.model_copy(update={"text": next(redacted)}) if part.is_text else part for part in message.content
    ]
    return message.model_copy(update={"content": content})


def _calls(
    tool_calling: ToolCalling | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ParsedCall]] | None:
    """(content, calls) of a finished answer that made calls, else None: its text is all content."""
    if tool_calling is None or finish_reason != "stop":
        return None
    content, calls = tool_calling.extract(text)
    return (content, calls) if calls else None


class _ToolCallStream:
    """Streams an answer that may hold calls. Text that cannot be part of a call goes out as content as it
    comes. A call is announced (index, id, type, name, arguments "") once its name is written, then its
    arguments follow as the model writes them. What a parser cannot yet place is held back: with `hermes`,
    text from `<tool_call>` (or a tail that may begin one) until the call's name is read; with `llama3_json`,
    an output that begins with `{` until the name is read; content after a call waits for the end.

    A call announced cannot be taken back: if the output then strays from the format, the text not yet sent
    as content follows as content, and the answer finishes as a plain one. A call cut short (max_tokens)
    keeps the arguments sent, as OpenAI's streams do. Log probabilities are not streamed."""

    def __init__(self, tool_calling: ToolCalling, n: int) -> None:
        self.tool_calling = tool_calling
        self.readers = [tool_calling.reader() for _ in range(n)]
        self.sent_content = [0] * n
        # Per choice, the calls announced: how much of each one's arguments has been sent.
        self.sent_arguments: list[list[int]] = [[] for _ in range(n)]

    def __call__(self, _: int, completion: CompletionOutput, finished: bool) -> list[dict[str, Any]]:
        index = completion.index
        reader = self.readers[index]
        reading = reader.read(completion.text)
        text = reader.text
        if reading.malformed:
            return self._finishing(index, self._content(index, text), None, text, finished)
        if not finished:
            return self._choices(index, self._content(index, text, reading.content_end), reading, text)
        calls = _calls(self.tool_calling, text, completion.finish_reason)
        if calls is not None:
            content, _ = calls
            choices = self._finishing(index, self._content(index, content or ""), reading, text, True)
            return [*choices[:-1], {**choices[-1], "finish_reason": "tool_calls"}]
        if completion.finish_reason != "stop" and self.sent_arguments[index]:
            return self._finishing(index, self._content(index, reading.content(text)), reading, text, True)
        return self._finishing(index, self._content(index, text), None, text, True)

    def _finishing(
        self, index: int, content: str, reading: OutputReading | None, text: str, finished: bool
    ) -> list[dict[str, Any]]:
        """The choices to send, with an empty one to carry the finish reason when there is nothing else."""
        choices = self._choices(index, content, reading, text)
        return choices or ([{"index": index, "delta": {}, "logprobs": None}] if finished else [])

    def _content(self, index: int, content: str, end: int | None = None) -> str:
        """What of `content[:end]` (the answer's content so far) has not been sent."""
        end = len(content) if end is None else end
        unsent = content[self.sent_content[index] : end]
        self.sent_content[index] = max(self.sent_content[index], end)
        return unsent

    def _choices(
        self, index: int, content: str, reading: OutputReading | None, text: str
    ) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        sent = self.sent_arguments[index]
        calls = reading.calls if reading is not None else []
        # The calls before the last one announced have been sent whole.
        for number in range(max(len(sent) - 1, 0), len(calls)):
            call = calls[number]
            if call.name is None:
                break  # calls are announced in order
            if number == len(sent):
                announced = {"name": call.name, "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": number, "id": new_call_id(), "type": "function", "function": announced}
                        ]
                    }
                )
                sent.append(0)
            arguments = call.arguments(text, sent[number])
            if arguments:
                deltas.append({"tool_calls": [{"index": number, "function": {"arguments": arguments}}]})
                sent[number] += len(arguments)
        return [{"index": index, "delta": delta, "logprobs": None} for delta in deltas]
