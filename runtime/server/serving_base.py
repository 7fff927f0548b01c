"""What the completion and chat handlers share: admission checks, prompt validation, running requests,
the event stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.tiers import PRIORITY_HEADER, parse_priority, tier_of
from kvfleet.runtime.chat_prompt import (
    chat_prompt_token_ids,
    longest_token_characters,
    prompt_text,
    text_fields,
)
from kvfleet.runtime.engine.errors import EngineError, InvalidRequestError
from kvfleet.runtime.engine.input_checks import check_prompt_token_ids, check_sampling_token_ids
from kvfleet.runtime.engine.messages import EngineInfo
from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.runtime.server.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    OpenAIError,
    PermissionDeniedError,
    RequestTimeoutError,
    ServiceUnavailableError,
    from_engine_error,
)
from kvfleet.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    template_messages,
    usage,
)
from kvfleet.runtime.server.safety import CONTENT_FILTER, RequestSafety, sent_tokens
from kvfleet.runtime.server.state import ServerState
from kvfleet.runtime.server.streaming import SSE_DONE, merge_streams, prepend, sse_event, unless_disconnected
from kvfleet.runtime.structured_outputs.grammars import GrammarError, check_constraint
from starlette.requests import Request


@dataclass
class PreparedRequest:
    request_id: str
    created: int
    # The model name responses carry: the served model's, or the LoRA adapter's.
    model: str
    prompt_token_ids: list[list[int]]
    params: SamplingParams
    priority: int
    timeout: float | None
    arrival_time: float
    lora_request: LoRARequest | None
    safety: RequestSafety | None = None
    # The images of a chat request's one prompt.
    mm_features: list[MultiModalFeature] = field(default_factory=list)


@dataclass
class Choice:
    """One generated sequence, accumulated from delta outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text += completion.text
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            self.logprobs = (self.logprobs or []) + completion.logprobs
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason


# (prompt index, delta, whether it finished the sequence) -> the choices to stream, one chunk each (none: send
# nothing).
ChoiceBuilder = Callable[[int, CompletionOutput, bool], list[dict[str, Any]]]


def finish_error(finish_reason: str | None) -> OpenAIError | None:
    """Finish reasons that are failures, not answers."""
    if finish_reason == "timeout":
        return RequestTimeoutError("the request did not finish within its timeout", code="timeout")
    if finish_reason == "error":
        return InternalServerError("the model failed while running this request")
    if finish_reason == "abort":
        return ServiceUnavailableError("the request was stopped by the server", code="aborted")
    return None


class OpenAIServing:
    # The "object" of a streamed chunk in the OpenAI API.
    chunk_object: str
    id_prefix = "cmpl"

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @property
    def tokenizer(self) -> Any:
        return self.state.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.state.settings.served_model_name

    # ---- checks ----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request names as its model, or None for the served model itself."""
        if model is None or model == self.model_name:
            return None
        adapters = self.state.lora_adapters
        lora = adapters.get(model) if adapters is not None else None
        if lora is None:
            names = (
                [self.model_name, *(served.lora.lora_name for served in adapters.loaded)]
                if adapters
                else [self.model_name]
            )
            raise NotFoundError(
                f"the model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                param="model",
                code="model_not_found",
            )
        return lora

    def check_accepting(self, priority: int) -> None:
        """New requests are refused while draining, and fail at once if the engine cannot serve any more.
        While the model loads they are accepted and wait for it."""
        state = self.state
        if state.draining:
            state.metrics.record_rejected("draining", tier_of(priority))
            raise ServiceUnavailableError(state.not_ready_reason(), code="draining")
        if state.engine.error is not None:
            raise from_engine_error(state.engine.error)

    def resolve_priority(self, body_priority: int | str | None, raw_request: Request) -> int:
        """The body's field, else the header, else the server's default."""
        if body_priority is not None:
            source, value = "priority", body_priority
        elif PRIORITY_HEADER in raw_request.headers:
            source, value = PRIORITY_HEADER, raw_request.headers[PRIORITY_HEADER]
        else:
            return self.state.settings.default_priority
        try:
            priority = parse_priority(value)
        except ValueError as exc:
            raise BadRequestError(str(exc), param=source) from None
        allowed = self.state.settings.max_priority_tier
        if priority < allowed:
            raise PermissionDeniedError(
                f"requests may not claim the {tier_of(priority)!r} tier here; the most urgent one they may "
                f"claim is {tier_of(allowed)!r}",
                param=source,
            )
        return priority

    def request_safety(self, priority: int) -> RequestSafety | None:
        """The guardrails of a request of this priority's tier (the default tier's, where that tier's policy
        is looser); None when its policy checks nothing."""
        guardrails = self.state.guardrails
        if guardrails is None:
            return None
        default_tier = tier_of(self.state.settings.default_priority)
        safety = RequestSafety(guardrails, guardrails.config.claimed_policy(tier_of(priority), default_tier))
        return safety if safety.checks_input or safety.checks_output else None

    async def sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The body's sampling parameters; `tool_constraint` is what tool_choice constrains the output to."""
        params = body.sampling_params()
        max_n = self.state.settings.max_n
        if params.n > max_n:
            raise BadRequestError(f"n must be at most {max_n} on this server, got {params.n}", param="n")
        param = "structured_outputs" if body.structured_outputs else "response_format"
        if tool_constraint is not None:
            if params.structured_outputs is not None:
                raise BadRequestError(
                    f"{param} cannot be combined with a tool_choice that forces a call", param=param
                )
            params.structured_outputs, param = tool_constraint, "tools"
        if params.structured_outputs is not None:
            await self._check_constraint(params.structured_outputs, param)
        return params

    async def _check_constraint(self, structured: StructuredOutputsParams, param: str) -> None:
        """A 400 for a JSON schema the engine could not enforce, before it is queued."""

        def work(_: Any) -> None:
            try:
                check_constraint(structured)
            except GrammarError as exc:
                raise BadRequestError(str(exc), param=param) from None

        await self.state.engine.run_tokenizer(work)

    def check_prompt(self, token_ids: list[int], params: SamplingParams, param: str) -> None:
        max_model_len = self.engine_info.max_model_len
        if len(token_ids) >= max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens, leaving no room for output",
                param=param,
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but "
                f"{len(token_ids) + params.max_tokens} were requested ({len(token_ids)} in the prompt, "
                f"{params.max_tokens} for the completion); lower max_tokens or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            check_prompt_token_ids(
                token_ids,
                params.stop_token_ids or [],
                vocab_size=self.engine_info.vocab_size,
                max_model_len=max_model_len,
            )
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc), param=param) from None
        try:
            check_sampling_token_ids(params, vocab_size=self.engine_info.vocab_size)
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc), param=str(exc).split(" ", 1)[0]) from None
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(token_ids)
        limit = self.state.settings.max_completion_tokens_per_prompt
        if params.n * max_tokens > limit:
            budget = "max_tokens" if params.max_tokens is not None else "the room left (max_tokens unset)"
            raise BadRequestError(
                f"n x {budget} = {params.n} x {max_tokens} = {params.n * max_tokens} tokens to generate for "
                f"one prompt, more than this server's limit of {limit}; lower n or max_tokens",
                param="n" if params.n > 1 else "max_tokens",
            )

    async def encode(self, text: str, *, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of a text that fits the model's context, computed off the event loop."""

        def work(tokenizer: Any) -> list[int]:
            self._refuse_beyond_context(tokenizer, len(text), param)
            # The batch call releases the interpreter lock while it encodes; the single-text one does not.
            encoding = tokenizer.backend_tokenizer.encode_batch(
                [text], add_special_tokens=add_special_tokens
            )[0]
            self._check_context(len(encoding), param)
            return encoding.ids

        return await self.state.engine.run_tokenizer(work)

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt of a conversation (and the tools it may call), rendered and tokenized off the event
        loop."""
        conversation = template_messages(messages)
        characters = sum(len(text) for text in text_fields([conversation, tools]))

        def work(tokenizer: Any) -> list[int]:
            self._refuse_beyond_context(tokenizer, characters, "messages")
            try:
                token_ids = chat_prompt_token_ids(
                    tokenizer, conversation, add_generation_prompt=add_generation_prompt, tools=tools
                )
            except ValueError as exc:
                raise BadRequestError(str(exc), param="messages") from None
            self._check_context(len(token_ids), "messages")
            return token_ids

        return await self.state.engine.run_tokenizer(work)

    async def prompt_text(self, token_ids: list[int]) -> str:
        """A prompt's text as the model reads it, decoded off the event loop."""
        return await self.state.engine.run_tokenizer(lambda tokenizer: prompt_text(tokenizer, token_ids))

    def _refuse_beyond_context(self, tokenizer: Any, characters: int, param: str) -> None:
        """Refuse, without tokenizing it, a text longer than the whole context could hold even in the
        vocabulary's longest tokens (twice over, for normalizers that shorten text). Tokenizing millions of
        tokens would take seconds only to refuse them, and building their list would hold the interpreter
        lock, and so the event loop, all that time."""
        max_model_len = self.engine_info.max_model_len
        if characters > 2 * longest_token_characters(tokenizer) * max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the {param} has "
                f"{characters} characters, more than that many tokens can hold",
                param=param,
                code="context_length_exceeded",
            )

    def _check_context(self, num_tokens: int, param: str) -> None:
        max_model_len = self.engine_info.max_model_len
        if num_tokens > max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the {param} has "
                f"{num_tokens} tokens",
                param=param,
                code="context_length_exceeded",
            )

    @property
    def engine_info(self) -> EngineInfo:
        info = self.state.engine.info
        assert info is not None, "called once the engine is ready"
        return info

    def prepare(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        priority: int,
        timeout: float | None,
        arrival_time: float,
        lora_request: LoRARequest | None,
        safety: RequestSafety | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> PreparedRequest:
        return PreparedRequest(
            request_id=f"{self.id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=lora_request.lora_name if lora_request is not None else self.model_name,
            prompt_token_ids=prompt_token_ids,
            params=params,
            priority=priority,
            timeout=timeout if timeout is not None else self.state.settings.request_timeout,
            arrival_time=arrival_time,
            lora_request=lora_request,
            safety=safety,
            mm_features=mm_features or [],
        )

    # ---- running ---------------------------------------------------------------------------------

    def outputs(
        self, request: PreparedRequest, *, stream: bool = False
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) of every prompt of the request, merged; behind the request's input
        check, and when streamed its output checked window by window."""
        engine = self.state.engine
        streams = [
            engine.generate(
                f"{request.request_id}-{index}",
                token_ids,
                request.params,
                priority=request.priority,
                timeout=request.timeout,
                arrival_time=request.arrival_time,
                lora_request=request.lora_request,
                mm_features=request.mm_features,
            )
            for index, token_ids in enumerate(request.prompt_token_ids)
        ]
        merged = merge_streams(streams)
        safety = request.safety
        if safety is None:
            return merged
        merged = safety.after_input_check(merged)
        if stream and safety.checks_output:
            merged = safety.output_windows(merged, len(request.prompt_token_ids), request.params.n)
        return merged

    async def collect(self, raw_request: Request, request: PreparedRequest) -> list[list[Choice]]:
        """Run to the end (or the client's disconnect); choices per prompt, n per prompt."""
        choices = [[Choice() for _ in range(request.params.n)] for _ in request.prompt_token_ids]

        async def run() -> None:
            async with contextlib.aclosing(self.outputs(request)) as outputs:
                async for prompt_index, output in outputs:
                    for completion in output.outputs:
                        choices[prompt_index][completion.index].add(completion)

        await unless_disconnected(raw_request, run())
        for per_prompt in choices:
            for choice in per_prompt:
                error = finish_error(choice.finish_reason)
                if error is not None:
                    raise error
        if request.safety is not None and request.safety.checks_output:
            await self._check_outputs(
                request.safety, [choice for per_prompt in choices for choice in per_prompt]
            )
        return choices

    async def _check_outputs(self, safety: RequestSafety, choices: list[Choice]) -> None:
        """Whole answers checked at once: a blocked one becomes the refusal, finished by content_filter; what
        is sent of their tokens follows their text."""
        checked = await asyncio.gather(*(safety.checked_text(choice.text) for choice in choices))
        for choice, (text, blocked) in zip(choices, checked, strict=True):
            choice.token_ids, choice.logprobs = sent_tokens(
                choice.token_ids, choice.logprobs, blocked=blocked, redacted=text != choice.text
            )
            choice.text = text
            if blocked:
                choice.finish_reason = CONTENT_FILTER

    async def first_output(
        self, raw_request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> tuple[int, RequestOutput] | None:
        """Wait for the first output before committing to a 200 stream, so that a request shed, timed out or
        refused while queued still gets its proper status code."""
        try:
            return await unless_disconnected(raw_request, anext(outputs))
        except StopAsyncIteration:
            return None

    async def event_stream(
        self,
        request: PreparedRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        first: tuple[int, RequestOutput] | None,
        choice_of: ChoiceBuilder,
        *,
        include_usage: bool,
        preamble: Iterable[dict[str, Any]] = (),
    ) -> AsyncIterator[str]:
        """The SSE events of a streamed request: `preamble` choices first, then the choices `choice_of` builds
        for each delta, the last one's finish reason set here; a failed request ends the stream with an error
        event; usage comes last when asked for."""
        completion_tokens = 0
        async with contextlib.aclosing(outputs):
            try:
                for choice in preamble:
                    yield sse_event(self._chunk(request, choice))
                async for prompt_index, output in prepend(first, outputs):
                    for completion in output.outputs:
                        completion_tokens += len(completion.token_ids)
                        error = finish_error(completion.finish_reason)
                        finished = error is None and completion.finish_reason is not None
                        choices = choice_of(prompt_index, completion, finished)
                        for number, choice in enumerate(choices, start=1):
                            # The last choice finishes; a builder may name its own reason (tool calls).
                            finish_reason = (
                                completion.finish_reason if finished and number == len(choices) else None
                            )
                            yield sse_event(self._chunk(request, {"finish_reason": finish_reason, **choice}))
                        if error is not None:
                            raise error
            except (OpenAIError, EngineError) as raised:
                error = from_engine_error(raised) if isinstance(raised, EngineError) else raised
                yield error.to_sse()
                yield SSE_DONE
                return
        if include_usage:
            prompt_tokens = sum(len(ids) for ids in request.prompt_token_ids)
            yield sse_event(self._chunk(request, None, usage(prompt_tokens, completion_tokens)))
        yield SSE_DONE

    # ---- formatting ------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top_logprobs(self, logprobs: dict[int, float], limit: int) -> list[tuple[str, float]]:
        best = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:limit]
        return [(self.token_text(token_id), logprob) for token_id, logprob in best]

    def _chunk(
        self, request: PreparedRequest, choice: dict[str, Any] | None, usage_: dict[str, int] | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": request.request_id,
            "object": self.chunk_object,
            "created": request.created,
            "model": request.model,
            "choices": [choice] if choice is not None else [],
        }
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk
