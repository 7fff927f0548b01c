"""POST /v1/chat/completions: the model folder's chat template turns the messages into one prompt."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.server.protocol import ChatCompletionRequest, usage
from kvfleet.runtime.server.serving_base import Choice, OpenAIServing, PreparedRequest
from kvfleet.runtime.server.streaming import EventStreamResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class OpenAIServingChat(OpenAIServing):
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    async def create_chat_completion(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        self.check_model(body.model)
        params = await self.sampling_params(body)
        priority = self.resolve_priority(body.priority, raw_request)
        self.check_accepting(priority)
        token_ids = await self.chat_prompt(body.messages, body.add_generation_prompt)
        self.check_prompt(token_ids, params, "messages")
        request = self.prepare(
            [token_ids], params, priority=priority, timeout=body.timeout, arrival_time=arrival_time
        )
        if body.stream:
            outputs = self.outputs(request)
            first = await self.first_output(raw_request, outputs)
            return EventStreamResponse(self._events(body, request, outputs, first))
        choices = (await self.collect(raw_request, request))[0]
        return JSONResponse(self._response(body, request, choices))

    def _response(self, body: ChatCompletionRequest, request: PreparedRequest, choices: list[Choice]) -> dict:
        return {
            "id": request.request_id,
            "object": "chat.completion",
            "created": request.created,
            "model": self.model_name,
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": choice.text},
                    "logprobs": self._logprobs(choice.token_ids, choice.logprobs, body.top_logprobs or 0),
                    "finish_reason": choice.finish_reason,
                }
                for index, choice in enumerate(choices)
            ],
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

        return self.event_stream(
            request, outputs, first, choice_of, include_usage=body.include_usage, preamble=roles
        )
