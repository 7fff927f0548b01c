"""POST /v1/completions: each prompt, as text or token ids, continued n times."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime.engine.outputs import CompletionOutput
from kvfleet.runtime.multimodal.inputs import MultiModalFeature, prompt_embeds_item
from kvfleet.runtime.pooler_config import GENERATE
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.serving.protocol import CompletionRequest, usage
from kvfleet.runtime.serving.request import PreparedRequest, Prompt
from kvfleet.runtime.serving.responses import (
    Choice,
    ChoiceBuilder,
    answered_logprob,
    completion_top_logprobs,
    prompt_logprobs_body,
    token_id_name,
    token_text,
)
from kvfleet.runtime.serving.safety import RequestSafety
from kvfleet.runtime.serving.token_names import TokenNames

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService

# A whole choice, or a streamed delta of one.
_Generated = TypeVar("_Generated", Choice, CompletionOutput)


class CompletionRoute:
    chunk_object = "text_completion"
    id_prefix = "cmpl"
    keeps_request_id = False
    task = GENERATE
    # Completions are raw text: reasoning is not told apart, as in vLLM.
    opens_in_reasoning = False
    reports_cached_tokens = False
    tool_constraint: StructuredOutputsParams | None = None

    def __init__(
        self,
        body: CompletionRequest,
        fields: list[str] | None = None,
        tokens_as_ids: bool = False,
        content_tokens: list[int] | None = None,
    ) -> None:
        """`fields`: the request field each prompt came from, named in errors (prompt.N by default).
        `tokens_as_ids`: the server's return_tokens_as_token_ids, for requests that leave it unset.
        `content_tokens`: how many of its own tokens each text prompt keeps (0: all; see service.encode)."""
        self.body = body
        self.fields = fields
        self.content_tokens = content_tokens
        self.tokens_as_ids = body.tokens_as_ids(tokens_as_ids)
        self.prompts: list[str | list[int]] = []
        # Each prompt's text, which answers begin with when the request asks for echo.
        self.echoes: list[str] | None = None

    async def prompt(self, service: OpenAIService, safety: RequestSafety | None) -> Prompt:
        """The prompts tokenized, token-id prompts taken as they are; prompt embeddings before them, as
        vLLM orders them."""
        body = self.body
        embedded = await self._embedded(service, safety)
        prompts = body.prompts()
        fields = self.fields or _fields("prompt", len(prompts))
        if safety is not None and safety.redacts_input:
            prompts = await _redacted(service, safety, prompts, fields)
        truncation = await service.truncation(body, self.task)
        content_tokens = self.content_tokens or [0] * len(prompts)
        token_lists = []
        for prompt, field, kept in zip(prompts, fields, content_tokens, strict=True):
            if isinstance(prompt, str):
                token_ids = await service.encode(
                    prompt,
                    add_special_tokens=body.add_special_tokens,
                    param=field,
                    truncation=truncation,
                    content_tokens=kept,
                )
            else:
                token_ids = prompt
                await service.engine.wait_ready(service.engine.startup_request_timeout)
            token_lists.append(token_ids)
        self.prompts = prompts
        if not embedded:
            return Prompt(token_lists, fields)
        return Prompt(
            [token_ids for token_ids, _ in embedded] + token_lists,
            _fields("prompt_embeds", len(embedded)) + fields,
            [[feature] for _, feature in embedded] + [[] for _ in prompts],
        )

    async def _embedded(
        self, service: OpenAIService, safety: RequestSafety | None
    ) -> list[tuple[list[int], MultiModalFeature]]:
        """The prompts given as embeddings: their placeholder tokens, and the item over them."""
        body = self.body
        encoded = body.embedded_prompts()
        if not encoded:
            return []
        if safety is not None and safety.checks_input:
            raise BadRequestError(
                "prompt_embeds cannot be read by the input checks of this request's tier",
                param="prompt_embeds",
            )
        if not service.engine.config.enable_prompt_embeds:
            raise BadRequestError(
                "prompt_embeds are taken by a server started with --enable-prompt-embeds",
                param="prompt_embeds",
            )
        if body.echo:
            raise BadRequestError("echo has no text to repeat for prompt_embeds", param="echo")
        if body.prompt_logprobs is not None:
            raise BadRequestError("prompt_logprobs are not scored for prompt_embeds", param="prompt_logprobs")
        from kvfleet.runtime.prompt_embeds import decoded_prompt_embeds  # torch, on the server's side only

        await service.engine.wait_ready(service.engine.startup_request_timeout)
        hidden_size = service.engine_info.hidden_size
        items = []
        for text, param in zip(encoded, _fields("prompt_embeds", len(encoded)), strict=True):
            try:
                embeddings = await asyncio.to_thread(decoded_prompt_embeds, text)
            except ValueError as error:
                raise BadRequestError(str(error), param=param) from None
            if embeddings.shape[1] != hidden_size:
                raise BadRequestError(
                    f"prompt embeddings {embeddings.shape[1]} wide for a model of hidden size {hidden_size}",
                    param=param,
                )
            items.append(prompt_embeds_item(embeddings))
        return items

    def input_text(self, service: OpenAIService, safety: RequestSafety | None) -> str | None:
        """The prompts' texts, joined; here too the echoes are read, from prompts that have passed their
        checks (token ids are decoded)."""
        checks_text = safety is not None and not safety.redacts_input
        texts = [_text(service, prompt) for prompt in self.prompts] if checks_text or self.body.echo else []
        if self.body.echo:
            self.echoes = texts
        return "\n".join(texts) if checks_text else None

    def response(
        self,
        request: PreparedRequest,
        choices: list[list[Choice]],
        tokenizer: Any,
        cached_tokens: int | None,
    ) -> dict[str, Any]:
        n = request.params.n
        entries = []
        for prompt_index, per_prompt in enumerate(choices):
            prompt_token_ids = request.prompt_token_ids[prompt_index]
            for sequence_index, generated in enumerate(per_prompt):
                choice = _unanswered(generated) if self.body.echoes_only else generated
                prefix = self.echoes[prompt_index] if self.echoes else ""
                logprobs = self._logprobs(
                    self._logged(tokenizer),
                    (prompt_token_ids, choice.prompt_logprobs) if self.echoes else None,
                    choice.token_ids,
                    choice.logprobs,
                )
                entry = {
                    "index": prompt_index * n + sequence_index,
                    "text": prefix + choice.text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
                # Asked for, or scored for an echo with logprobs: vLLM answers them in both cases.
                if choice.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = prompt_logprobs_body(
                        tokenizer, prompt_token_ids, choice.prompt_logprobs
                    )
                if self.body.return_token_ids:
                    entry["prompt_token_ids"] = request.prompt_token_ids[prompt_index]
                    entry["token_ids"] = choice.token_ids
                entries.append(entry)
        completion_tokens = sum(len(choice.token_ids) for per_prompt in choices for choice in per_prompt)
        return {
            "id": request.request_id,
            "object": "text_completion",
            "created": request.created,
            "model": request.model,
            "choices": entries,
            "usage": usage(
                sum(len(ids) for ids in request.prompt_token_ids), completion_tokens, cached_tokens
            ),
        }

    def _logged(self, tokenizer: Any) -> _ChoiceLogprobs | None:
        """A choice's logprobs, where the request asks for them."""
        limit = self.body.logprobs
        return None if limit is None else _ChoiceLogprobs(tokenizer, limit, self.tokens_as_ids)

    def _logprobs(
        self,
        logged: _ChoiceLogprobs | None,
        echo: tuple[list[int], list[PromptTokenLogprobs | None] | None] | None,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
    ) -> dict[str, list[Any]] | None:
        """The logprobs of a choice's new tokens, after its echoed prompt's (`echo`: the prompt's tokens and
        their scores) where it begins with one."""
        if logged is None or logprobs is None:
            return None
        parts = []
        if echo is not None:
            prompt_token_ids, prompt_logprobs = echo
            assert prompt_logprobs is not None, "echo with logprobs asks for the prompt's"
            parts.append(logged.prompt(prompt_token_ids, prompt_logprobs))
        parts.append(logged.answer(token_ids, logprobs))
        return {field: [value for part in parts for value in part[field]] for field in parts[0]}

    def preamble(self, request: PreparedRequest) -> list[dict[str, Any]]:
        return []

    def first_chunk_fields(self, request: PreparedRequest) -> dict[str, Any]:
        return {}

    def choice_builder(
        self,
        request: PreparedRequest,
        tokenizer: Any,
        prompt_logprobs: Mapping[int, list[PromptTokenLogprobs | None]],
    ) -> ChoiceBuilder:
        """Each choice's first chunk begins with the echo, when asked for, its logprobs with the prompt's."""
        n = request.params.n
        echoes = self.echoes
        # Each choice's logprobs so far, which name its next tokens and count their offsets.
        logged: dict[int, _ChoiceLogprobs | None] = {}
        return_token_ids = bool(self.body.return_token_ids)
        # The choices whose first chunk (which carries the echo, or the prompt's token ids) has been sent.
        started: set[int] = set()

        def choice_of(
            prompt_index: int, completion: CompletionOutput, finished: bool
        ) -> list[dict[str, Any]]:
            index = prompt_index * n + completion.index
            if self.body.echoes_only:
                completion = _unanswered(completion)
            echo = echoes[prompt_index] if echoes and index not in started else ""
            text = echo + completion.text
            new_token_ids = return_token_ids and bool(completion.token_ids)
            if not (text or finished or completion.logprobs or new_token_ids):
                return []
            prompt_token_ids = request.prompt_token_ids[prompt_index]
            logprobs = self._logprobs(
                logged.setdefault(index, self._logged(tokenizer)),
                (prompt_token_ids, prompt_logprobs.get(prompt_index)) if echo else None,
                completion.token_ids,
                completion.logprobs,
            )
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
            # As vLLM streams them: the prompt's tokens come with the echo, or with the first ids asked for.
            if echo or (return_token_ids and index not in started):
                choice["prompt_token_ids"] = prompt_token_ids
            if return_token_ids:
                choice["token_ids"] = completion.token_ids
            started.add(index)
            return [choice]

        return choice_of


class _ChoiceLogprobs:
    """One choice's logprobs in OpenAI's legacy shape, from one chunk to the next: its tokens named in order,
    at offsets that count their texts as vLLM's do (a special token's too, which an echo leaves out of the
    text; and a token's text whatever name it carries)."""

    def __init__(self, tokenizer: Any, limit: int, as_ids: bool) -> None:
        self._tokenizer = tokenizer
        self._limit = limit
        self._as_ids = as_ids
        self._names = TokenNames(tokenizer)
        self._offset = 0

    def prompt(self, token_ids: list[int], scores: list[PromptTokenLogprobs | None]) -> dict[str, list[Any]]:
        """An echoed prompt's tokens, the first without a logprob: nothing before it scores it."""
        names = TokenNames(self._tokenizer)
        return _columns(
            [
                self._row(token_id, None, {token_id: token_text(self._tokenizer, token_id)})
                if scored is None
                else self._row(token_id, scored.logprobs, names.next(token_id, scored.logprobs))
                for token_id, scored in zip(token_ids, scores, strict=True)
            ]
        )

    def answer(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, list[Any]]:
        return _columns(
            [
                self._row(token_id, scored, self._names.next(token_id, scored))
                for token_id, scored in zip(token_ids, logprobs, strict=False)
            ]
        )

    def _row(
        self, token_id: int, scored: dict[int, float] | None, names: dict[int, str]
    ) -> tuple[str, float | None, dict[str, float] | None, int]:
        text = names[token_id]
        name = token_id_name(token_id) if self._as_ids else text
        offset, self._offset = self._offset, self._offset + len(text)
        if scored is None:
            return name, None, None, offset
        top = completion_top_logprobs(names, scored, token_id, self._limit, self._as_ids)
        return name, answered_logprob(scored[token_id]), top, offset


def _columns(rows: list[tuple[str, float | None, dict[str, float] | None, int]]) -> dict[str, list[Any]]:
    """Rows of (token, its logprob, its top_logprobs, its offset) as logprobs answer them, a list each."""
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {field: [row[column] for row in rows] for column, field in enumerate(fields)}


def _unanswered(generated: _Generated) -> _Generated:
    """What an echo of the prompt alone answers of a choice: none of the token the engine ran it for."""
    return dataclasses.replace(
        generated, text="", token_ids=[], logprobs=None if generated.logprobs is None else []
    )


def _fields(name: str, count: int) -> list[str]:
    """The field each of `count` prompts came from, as errors name it."""
    return [name] if count == 1 else [f"{name}.{index}" for index in range(count)]


def _text(service: OpenAIService, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt)


async def _redacted(
    service: OpenAIService, safety: RequestSafety, prompts: list[str | list[int]], fields: list[str]
) -> list[str | list[int]]:
    """The prompts with what the input checkers found redacted; token-id prompts cannot be, so one that
    would need it is refused."""
    if not all(isinstance(prompt, str) for prompt in prompts):
        # Token ids are read as text with the tokenizer, which comes with the model.
        await service.engine.wait_ready(service.engine.startup_request_timeout)
    texts = [_text(service, prompt) for prompt in prompts]
    decisions = await asyncio.gather(*(safety.checked_input(text) for text in texts))
    redacted = [decision.text for decision in decisions]
    for prompt, field, old, new in zip(prompts, fields, texts, redacted, strict=True):
        if not isinstance(prompt, str) and new != old:
            raise BadRequestError(
                "this prompt of token ids holds text the safety policy redacts; send it as text",
                param=field,
                code="content_filter",
            )
    return [new if isinstance(prompt, str) else prompt for prompt, new in zip(prompts, redacted, strict=True)]
