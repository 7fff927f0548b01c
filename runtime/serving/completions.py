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
    prompt_logprobs_body,
    token_id_name,
    token_text,
    top_logprobs,
)
from kvfleet.runtime.serving.safety import RequestSafety

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
        truncation = await service.truncation(body)
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
                logprobs = self._logprobs(tokenizer, choice.token_ids, choice.logprobs, len(prefix))
                if logprobs is not None and self.echoes:
                    logprobs = self._with_prompt(
                        tokenizer, prompt_token_ids, choice.prompt_logprobs, logprobs
                    )
                entry = {
                    "index": prompt_index * n + sequence_index,
                    "text": prefix + choice.text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
                if self.body.prompt_logprobs is not None and choice.prompt_logprobs is not None:
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

    def _logprobs(
        self, tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]] | None, offset: int
    ) -> dict[str, Any] | None:
        limit = self.body.logprobs
        if logprobs is None or limit is None:
            return None
        as_ids = self.tokens_as_ids
        tokens, offsets = self._named(tokenizer, token_ids, offset)
        return {
            "tokens": tokens,
            "token_logprobs": [
                answered_logprob(entry[token_id])
                for token_id, entry in zip(token_ids, logprobs, strict=False)
            ],
            "top_logprobs": [
                dict(top_logprobs(tokenizer, entry, limit, as_ids)) if limit else None for entry in logprobs
            ],
            "text_offset": offsets,
        }

    def _named(self, tokenizer: Any, token_ids: list[int], offset: int) -> tuple[list[str], list[int]]:
        """Each token's name in logprobs (its text, or token_id_name) and its offset into the text from
        `offset`, whatever name it carries."""
        names, offsets = [], []
        for token_id in token_ids:
            text = token_text(tokenizer, token_id)
            names.append(token_id_name(token_id) if self.tokens_as_ids else text)
            offsets.append(offset)
            offset += len(text)
        return names, offsets

    def _with_prompt(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        prompt_logprobs: list[PromptTokenLogprobs | None] | None,
        answer: dict[str, Any],
    ) -> dict[str, Any]:
        """An echoed answer's logprobs: its prompt's tokens first (the first without a logprob: nothing
        before it scores it), at offsets from the start of the echoed text."""
        assert prompt_logprobs is not None, "echo with logprobs asks for the prompt's"
        limit, as_ids = self.body.logprobs, self.tokens_as_ids
        tokens, offsets = self._named(tokenizer, prompt_token_ids, 0)
        scored = [
            (None, None)
            if scores is None
            else (
                answered_logprob(scores.logprobs[token_id]),
                dict(top_logprobs(tokenizer, scores.logprobs, limit, as_ids)) if limit else None,
            )
            for token_id, scores in zip(prompt_token_ids, prompt_logprobs, strict=True)
        ]
        return {
            "tokens": tokens + answer["tokens"],
            "token_logprobs": [logprob for logprob, _ in scored] + answer["token_logprobs"],
            "top_logprobs": [top for _, top in scored] + answer["top_logprobs"],
            "text_offset": offsets + answer["text_offset"],
        }

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
        counts_offsets = self.body.logprobs is not None
        # Each choice's offset of its next token, as an unstreamed answer counts it: by its tokens' texts
        # (the text sent may hold a token's back, the start of a character another token ends).
        next_offsets: dict[int, int] = {}
        return_token_ids = bool(self.body.return_token_ids)
        # The choices whose first chunk (which carries the prompt's token ids) has been sent.
        started: set[int] = set()

        def choice_of(
            prompt_index: int, completion: CompletionOutput, finished: bool
        ) -> list[dict[str, Any]]:
            index = prompt_index * n + completion.index
            if self.body.echoes_only:
                completion = _unanswered(completion)
            echo = echoes[prompt_index] if echoes and index not in next_offsets else ""
            text = echo + completion.text
            offset = next_offsets.get(index, 0) + len(echo)
            next_offsets[index] = offset + (
                _texts_length(tokenizer, completion.token_ids) if counts_offsets else 0
            )
            new_token_ids = return_token_ids and bool(completion.token_ids)
            if not (text or finished or completion.logprobs or new_token_ids):
                return []
            logprobs = self._logprobs(tokenizer, completion.token_ids, completion.logprobs, offset)
            if logprobs is not None and echo:
                logprobs = self._with_prompt(
                    tokenizer,
                    request.prompt_token_ids[prompt_index],
                    prompt_logprobs.get(prompt_index),
                    logprobs,
                )
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
            if return_token_ids:
                if index not in started:
                    choice["prompt_token_ids"] = request.prompt_token_ids[prompt_index]
                choice["token_ids"] = completion.token_ids
            started.add(index)
            return [choice]

        return choice_of


def _unanswered(generated: _Generated) -> _Generated:
    """What an echo of the prompt alone answers of a choice: none of the token the engine ran it for."""
    return dataclasses.replace(
        generated, text="", token_ids=[], logprobs=None if generated.logprobs is None else []
    )


def _texts_length(tokenizer: Any, token_ids: list[int]) -> int:
    """How far the tokens move the offsets in logprobs: the length of each one's text."""
    return sum(len(token_text(tokenizer, token_id)) for token_id in token_ids)


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
