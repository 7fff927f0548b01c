"""POST /v1/chat/completions: the model folder's chat template turns the messages into one prompt."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.server.errors import OpenAIError
from kvfleet.runtime.server.protocol import ChatCompletionRequest, usage
from kvfleet.runtime.server.serving_base import Choice, OpenAIServing, PreparedRequest, finish_error
from kvfleet.runtime.server.streaming import SSE_DONE, EventStreamResponse, prepend, sse_event
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class OpenAIServingChat(OpenAIServing):
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    async def create_chat_completion(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        self.check_model(body.model)
        params = body.sampling_params()
        priority = self.resolve_priority(body.priority, raw_request)
        self.check_accepting(priority)
        token_ids = self.apply_chat_template(body.messages, body.add_generation_prompt)
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

    async def _events(
        self,
        body: ChatCompletionRequest,
        request: PreparedRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        first: tuple[int, RequestOutput] | None,
    ) -> AsyncIterator[str]:
        completion_tokens = 0
        async with contextlib.aclosing(outputs):
            try:
                for index in range(request.params.n):
                    role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield sse_event(self._chunk(request, {**role, "finish_reason": None}))
                async for _, output in prepend(first, outputs):
                    for completion in output.outputs:
                        completion_tokens += len(completion.token_ids)
                        error = finish_error(completion.finish_reason)
                        finished = error is None and completion.finish_reason is not None
                        if completion.text or finished or completion.logprobs:
                            choice = {
                                "index": completion.index,
                                "delta": {"content": completion.text} if completion.text else {},
                                "logprobs": self._logprobs(
                                    completion.token_ids, completion.logprobs, body.top_logprobs or 0
                                ),
                                "finish_reason": None if error else completion.finish_reason,
                            }
                            yield sse_event(self._chunk(request, choice))
                        if error is not None:
                            raise error
            except OpenAIError as error:
                yield error.to_sse()
                yield SSE_DONE
                return
        if body.include_usage:
            yield sse_event(
                self._chunk(request, None, usage(len(request.prompt_token_ids[0]), completion_tokens))
            )
        yield SSE_DONE
