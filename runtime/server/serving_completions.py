"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.server.errors import BadRequestError
from kvfleet.runtime.server.protocol import CompletionRequest, usage
from kvfleet.runtime.server.safety import RequestSafety
from kvfleet.runtime.server.serving_base import Choice, OpenAIServing, PreparedRequest
from kvfleet.runtime.server.streaming import EventStreamResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class OpenAIServingCompletion(OpenAIServing):
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        lora_request = self.check_model(body.model)
        params = await self.sampling_params(body)
        priority = self.resolve_priority(body.priority, raw_request)
        self.check_accepting(priority)
        prompts = body.prompts()
        safety = self.request_safety(priority)
        if safety is not None and safety.redacts_input:
            prompts = await self._redacted(safety, prompts)
        token_lists = []
        for index, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{index}"
            if isinstance(prompt, str):
                token_ids = await self.encode(prompt, add_special_tokens=body.add_special_tokens, param=param)
            else:
                token_ids = prompt
                await self.state.engine.wait_ready(self.state.engine.startup_request_timeout)
            self.check_prompt(token_ids, params, param)
            token_lists.append(token_ids)
        if safety is not None and not safety.redacts_input:
            safety.start_input_check("\n".join(map(self._echo_text, prompts)))
        request = self.prepare(
            token_lists,
            params,
            priority=priority,
            timeout=body.timeout,
            arrival_time=arrival_time,
            lora_request=lora_request,
            safety=safety,
        )
        echoes = [self._echo_text(prompt) for prompt in prompts] if body.echo else None
        if body.stream:
            outputs = self.outputs(request, stream=True)
            first = await self.first_output(raw_request, outputs)
            return EventStreamResponse(self._events(body, request, outputs, first, echoes))
        choices = await self.collect(raw_request, request)
        return JSONResponse(self._response(body, request, choices, echoes))

    async def _redacted(self, safety: RequestSafety, prompts: list[str | list[int]]) -> list[str | list[int]]:
        """The prompts with what the input checkers found redacted; token-id prompts cannot be, so one
        that would need it is refused."""
        if not all(isinstance(prompt, str) for prompt in prompts):
            # Token ids are read as text with the tokenizer, which comes with the model.
            await self.state.engine.wait_ready(self.state.engine.startup_request_timeout)
        texts = [self._echo_text(prompt) for prompt in prompts]
        decisions = await asyncio.gather(*(safety.checked_input(text) for text in texts))
        redacted = [decision.text for decision in decisions]
        for index, (prompt, old, new) in enumerate(zip(prompts, texts, redacted, strict=True)):
            if not isinstance(prompt, str) and new != old:
                raise BadRequestError(
                    "this prompt of token ids holds text the safety policy redacts; send it as text",
                    param="prompt" if len(prompts) == 1 else f"prompt.{index}",
                    code="content_filter",
                )
        return [
            new if isinstance(prompt, str) else prompt for prompt, new in zip(prompts, redacted, strict=True)
        ]

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
            "model": request.model,
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

    def _events(
        self,
        body: CompletionRequest,
        request: PreparedRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        first: tuple[int, RequestOutput] | None,
        echoes: list[str] | None,
    ) -> AsyncIterator[str]:
        n = request.params.n
        text_offsets: dict[int, int] = {}

        def choice_of(
            prompt_index: int, completion: CompletionOutput, finished: bool
        ) -> list[dict[str, Any]]:
            index = prompt_index * n + completion.index
            text = completion.text
            if echoes and index not in text_offsets:
                text = echoes[prompt_index] + text
            offset = text_offsets.get(index, 0)
            text_offsets[index] = offset + len(text)
            if not (text or finished or completion.logprobs):
                return []
            logprobs = self._logprobs(completion.token_ids, completion.logprobs, body.logprobs, offset)
            return [{"index": index, "text": text, "logprobs": logprobs}]

        return self.event_stream(request, outputs, first, choice_of, include_usage=body.include_usage)
