"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.server.errors import OpenAIError
from kvfleet.runtime.server.protocol import CompletionRequest, usage
from kvfleet.runtime.server.serving_base import Choice, OpenAIServing, PreparedRequest, finish_error
from kvfleet.runtime.server.streaming import SSE_DONE, EventStreamResponse, prepend, sse_event
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class OpenAIServingCompletion(OpenAIServing):
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        self.check_model(body.model)
        params = body.sampling_params()
        priority = self.resolve_priority(body.priority, raw_request)
        self.check_accepting(priority)
        prompts = body.prompts()
        token_lists = []
        for index, prompt in enumerate(prompts):
            token_ids = (
                self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
            )
            self.check_prompt(token_ids, params, "prompt" if len(prompts) == 1 else f"prompt.{index}")
            token_lists.append(token_ids)
        request = self.prepare(
            token_lists, params, priority=priority, timeout=body.timeout, arrival_time=arrival_time
        )
        echoes = [self._echo_text(prompt) for prompt in prompts] if body.echo else None
        if body.stream:
            return await self._stream(body, raw_request, request, echoes)
        choices = await self.collect(raw_request, request)
        return JSONResponse(self._response(body, request, choices, echoes))

    def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _response(
        self,
        body: CompletionRequest,
        request: PreparedRequest,
        choices: list[list[Choice]],
        echoes: list[str] | None,
    ) -> dict[str, Any]:
        n = request.params.n
        entries = []
        for prompt_index, per_prompt in enumerate(choices):
            for sequence_index, choice in enumerate(per_prompt):
                prefix = echoes[prompt_index] if echoes else ""
                entries.append(
                    {
                        "index": prompt_index * n + sequence_index,
                        "text": prefix + choice.text,
                        "logprobs": self._logprobs(
                            choice.token_ids, choice.logprobs, body.logprobs, len(prefix)
                        ),
                        "finish_reason": choice.finish_reason,
                    }
                )
        completion_tokens = sum(len(choice.token_ids) for per_prompt in choices for choice in per_prompt)
        return {
            "id": request.request_id,
            "object": "text_completion",
            "created": request.created,
            "model": self.model_name,
            "choices": entries,
            "usage": usage(sum(len(ids) for ids in request.prompt_token_ids), completion_tokens),
        }

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, limit: int | None, offset: int
    ) -> dict[str, Any] | None:
        if logprobs is None or limit is None:
            return None
        tokens, offsets = [], []
        for token_id in token_ids:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [entry[token_id] for token_id, entry in zip(token_ids, logprobs, strict=False)],
            "top_logprobs": [dict(self.top_logprobs(entry, limit)) if limit else None for entry in logprobs],
            "text_offset": offsets,
        }

    async def _stream(
        self,
        body: CompletionRequest,
        raw_request: Request,
        request: PreparedRequest,
        echoes: list[str] | None,
    ) -> Response:
        outputs = self.outputs(request)
        first = await self.first_output(raw_request, outputs)
        return EventStreamResponse(self._events(body, request, outputs, first, echoes))

    async def _events(
        self,
        body: CompletionRequest,
        request: PreparedRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        first: tuple[int, RequestOutput] | None,
        echoes: list[str] | None,
    ) -> AsyncIterator[str]:
        n = request.params.n
        text_offsets: dict[int, int] = {}
        completion_tokens = 0
        async with contextlib.aclosing(outputs):
            try:
                async for prompt_index, output in prepend(first, outputs):
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        completion_tokens += len(completion.token_ids)
                        text = completion.text
                        if echoes and index not in text_offsets:
                            text = echoes[prompt_index] + text
                        offset = text_offsets.get(index, 0)
                        text_offsets[index] = offset + len(text)
                        error = finish_error(completion.finish_reason)
                        finished = error is None and completion.finish_reason is not None
                        if text or finished or completion.logprobs:
                            choice = {
                                "index": index,
                                "text": text,
                                "logprobs": self._logprobs(
                                    completion.token_ids, completion.logprobs, body.logprobs, offset
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
            prompt_tokens = sum(len(ids) for ids in request.prompt_token_ids)
            yield sse_event(self._chunk(request, None, usage(prompt_tokens, completion_tokens)))
        yield SSE_DONE
