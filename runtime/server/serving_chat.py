"""POST /v1/chat/completions: the model folder's chat template turns the messages into one prompt."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.server.protocol import ChatCompletionRequest, usage
from kvfleet.runtime.server.serving_base import Choice, OpenAIServing, PreparedRequest
from kvfleet.runtime.server.streaming import EventStreamResponse
from kvfleet.runtime.server.tool_calls import ParsedCall, ToolCalling
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
        token_ids = await self.chat_prompt(body.messages, body.add_generation_prompt, tools)
        self.check_prompt(token_ids, params, "messages")
        request = self.prepare(
            [token_ids],
            params,
            priority=priority,
            timeout=body.timeout,
            arrival_time=arrival_time,
            lora_request=lora_request,
        )
        if body.stream:
            outputs = self.outputs(request)
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

        def choice_of(_: int, completion: CompletionOutput, finished: bool) -> dict[str, Any] | None:
            if not (completion.text or finished or completion.logprobs):
                return None
            return {
                "index": completion.index,
                "delta": {"content": completion.text} if completion.text else {},
                "logprobs": self._logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0),
            }

        builder = choice_of if tool_calling is None else _ToolCallStream(tool_calling, request.params.n)
        return self.event_stream(
            request, outputs, first, builder, include_usage=body.include_usage, preamble=roles
        )


def _calls(
    tool_calling: ToolCalling | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ParsedCall]] | None:
    """(content, calls) of a finished answer that made calls, else None: its text is all content."""
    if tool_calling is None or finish_reason != "stop":
        return None
    content, calls = tool_calling.extract(text)
    return (content, calls) if calls else None


class _ToolCallStream:
    """Streams an answer that may hold calls: text that cannot be part of a call goes out as content as it
    comes; the rest waits for the end, when it is read into tool_calls deltas (or sent as content, if it
    holds no well-formed call). Log probabilities are not streamed."""

    def __init__(self, tool_calling: ToolCalling, n: int) -> None:
        self.tool_calling = tool_calling
        self.texts = [""] * n
        self.sent = [0] * n

    def __call__(self, _: int, completion: CompletionOutput, finished: bool) -> dict[str, Any] | None:
        index = completion.index
        self.texts[index] += completion.text
        text, sent = self.texts[index], self.sent[index]
        if not finished:
            ready = self.tool_calling.streamable(text)
            if ready <= sent:
                return None
            self.sent[index] = ready
            return {"index": index, "delta": {"content": text[sent:ready]}, "logprobs": None}
        calls = _calls(self.tool_calling, text, completion.finish_reason)
        if calls is None:
            rest = text[sent:]
            return {"index": index, "delta": {"content": rest} if rest else {}, "logprobs": None}
        content, parsed = calls
        delta: dict[str, Any] = {"tool_calls": [call.as_openai(i) for i, call in enumerate(parsed)]}
        # The content streamed so far is the start of the answer's content; the rest goes with the calls.
        if content is not None and len(content) > sent:
            delta["content"] = content[sent:]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": "tool_calls"}
