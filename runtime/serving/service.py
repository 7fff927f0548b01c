"""The OpenAI service: the one admission every generating route goes through, the run step that yields the
engine's outputs, and the response body or stream of chunks made of them. It knows no transport: the HTTP
routes frame what it returns as JSON or SSE, and the batch runners record it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    BadRequestError,
    NotFoundError,
    OpenAIError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from kvfleet.contract.kv_transfer import DO_REMOTE_DECODE
from kvfleet.contract.resume import CONTINUATION, DRAINING_CODE
from kvfleet.contract.tiers import (
    DEFAULT_TIER,
    PRIORITY_HEADER,
    TIER_NAMES,
    TIERS,
    parse_priority,
    tier_of,
)
from kvfleet.runtime.chat_content_format import ContentFormatOption
from kvfleet.runtime.chat_prompt import (
    chat_prompt_token_ids,
    longest_token_characters,
    prompt_text,
    rendering_parameters,
    text_fields,
)
from kvfleet.runtime.engine.beam_search import beam_search_outputs
from kvfleet.runtime.engine.messages import EngineInfo
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.engine.sequences import ResumedSequence
from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.input_checks import (
    ContextLengthError,
    check_context_length,
    check_prompt_token_ids,
    check_resumed_token_ids,
    check_sampling_token_ids,
)
from kvfleet.runtime.kv_transfer.params import RemoteDecode, parse_kv_transfer_params
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.pooler_config import EMBED, GENERATE, PoolerConfig, served_tasks
from kvfleet.runtime.reasoning import ReasoningParser, reasoning_parser
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.sampling_params import (
    KV_TRANSFER_PARAMS,
    MAX_LOGPROBS,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from kvfleet.runtime.serving.chat import ChatRoute
from kvfleet.runtime.serving.chat_rendering import ChatRendering
from kvfleet.runtime.serving.completions import CompletionRoute
from kvfleet.runtime.serving.errors import from_engine_error
from kvfleet.runtime.serving.output_log import logged_outputs
from kvfleet.runtime.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Continuation,
    DetokenizeRequest,
    TokenizeRequest,
    Truncation,
    template_messages,
    usage,
)
from kvfleet.runtime.serving.request import NO_HEADERS, PreparedRequest, Prompt, RequestHeaders, Route
from kvfleet.runtime.serving.responses import Choice, chunk, finish_error
from kvfleet.runtime.serving.safety import CONTENT_FILTER, RequestSafety, sent_tokens
from kvfleet.runtime.serving.streams import merge_streams
from kvfleet.runtime.structured_outputs.grammars import GrammarError, check_constraint

if TYPE_CHECKING:
    from kvfleet.runtime.engine.protocol import EngineClient
    from kvfleet.runtime.metrics import ServerMetrics
    from kvfleet.runtime.serving.lora_adapters import LoRAAdapters
    from kvfleet.runtime.serving.safety import ServerGuardrails

logger = logging.getLogger(__name__)

# OpenAI's own limit on n.
DEFAULT_MAX_N = 128
# n = 128 sequences of a 2048-token context.
DEFAULT_MAX_COMPLETION_TOKENS_PER_PROMPT = 1 << 18
# Tokens past those a truncated text keeps, tokenized with them from a window of a text beyond the context.
_TRUNCATION_MARGIN_TOKENS = 64

# The routes of each task, as a refusal names them.
_TASK_ROUTES = {
    GENERATE: "completions, chat completions and responses",
    EMBED: "embeddings, score and rerank",
}


@dataclass(frozen=True)
class ServiceSettings:
    served_model_name: str
    default_priority: int = TIERS[DEFAULT_TIER]
    # Seconds; None = requests may run as long as they need.
    request_timeout: float | None = None
    max_n: int = DEFAULT_MAX_N
    # n x max_tokens for one prompt; a max_tokens of None counts as the room the prompt leaves in the context.
    max_completion_tokens_per_prompt: int = DEFAULT_MAX_COMPLETION_TOKENS_PER_PROMPT
    # The most urgent tier (its engine priority) a request may claim; more urgent claims get 403.
    max_priority_tier: int = TIERS[TIER_NAMES[0]]
    # tool_choice "auto": allowed, and the parser (a TOOL_CALL_PARSERS name) that reads calls from the output.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served.
    allow_runtime_lora_updates: bool = False
    # Other names requests may give the model by; answers carry the name they were asked with.
    served_model_aliases: tuple[str, ...] = ()
    # The most log probabilities per token a request may ask for.
    max_logprobs: int = MAX_LOGPROBS
    # SamplingParams fields given to requests that leave them unset (the model's generation_config.json).
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    # The most tokens any request generates, whatever it asks (a --generation-config folder's
    # max_new_tokens); None: no bound beyond the context.
    max_tokens_limit: int | None = None
    # The REASONING_PARSERS name that splits chat answers into reasoning and content; None: all content.
    reasoning_parser: str | None = None
    # vLLM's: how the chat template takes message content (kvfleet.runtime.chat_content_format).
    chat_template_content_format: ContentFormatOption = "auto"
    # vLLM's: usage counts the prompt tokens the prefix cache held (prompt_tokens_details.cached_tokens).
    enable_prompt_tokens_details: bool = False
    # vLLM's: every stream ends with its usage, whether or not stream_options asks for it.
    enable_force_include_usage: bool = False
    # vLLM's: logprobs name tokens "token_id:N" for requests that leave return_tokens_as_token_ids unset.
    return_tokens_as_token_ids: bool = False
    # vLLM's: a chat request whose tool_choice is "none" is rendered without its tools.
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's: chat template variables of requests that leave them unset.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # vLLM's: the role of a chat answer that the generation prompt opened.
    response_role: str = "assistant"
    # vLLM's: a chat request's own chat_template is rendered (a 400 otherwise).
    trust_request_chat_template: bool = False
    # vLLM's: each admitted request logged (its parameters at INFO, its prompt's token ids at DEBUG, the
    # first max_log_len of them; all with None).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # vLLM's: each sequence's output logged as it finishes (its text at INFO, its token ids at DEBUG), and a
    # stream's every delta with enable_log_deltas.
    enable_log_outputs: bool = False
    enable_log_deltas: bool = True

    @property
    def chat_rendering(self) -> ChatRendering:
        return ChatRendering(
            self.default_chat_template_kwargs,
            self.exclude_tools_when_tool_choice_none,
            self.chat_template_content_format,
        )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)


class OpenAIService:
    def __init__(
        self,
        engine: EngineClient,
        settings: ServiceSettings,
        *,
        metrics: ServerMetrics | None = None,
        lora_adapters: LoRAAdapters | None = None,
        guardrails: ServerGuardrails | None = None,
        refusal: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`refusal` says why new requests are refused for now (the server drains), or None."""
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.lora_adapters = lora_adapters
        self.guardrails = guardrails
        self.refusal = refusal

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @cached_property
    def reasoning(self) -> ReasoningParser | None:
        """The reasoning parser, bound to the tokenizer once the engine has one."""
        name = self.settings.reasoning_parser
        return reasoning_parser(name, self.tokenizer) if name is not None else None

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    @cached_property
    def tasks(self) -> frozenset[str]:
        """What this server answers: generation, embeddings, or both (the engine's runner and convert)."""
        config = self.engine.config
        return served_tasks(config.runner, config.convert)

    @cached_property
    def pooler(self) -> PoolerConfig:
        """How this server's embeddings are pooled."""
        return self.engine.config.pooler()

    @property
    def engine_info(self) -> EngineInfo:
        info = self.engine.info
        assert info is not None, "called once the engine is ready"
        return info

    # ---- admission -------------------------------------------------------------------------------

    async def create_chat_completion(
        self, body: ChatCompletionRequest, headers: RequestHeaders = NO_HEADERS
    ) -> PreparedRequest:
        return await self.admit(ChatRoute(body, self.settings), headers)

    async def create_completion(
        self, body: CompletionRequest, headers: RequestHeaders = NO_HEADERS
    ) -> PreparedRequest:
        route = CompletionRoute(body, tokens_as_ids=self.settings.return_tokens_as_token_ids)
        return await self.admit(route, headers)

    async def admit(self, route: Route, headers: RequestHeaders) -> PreparedRequest:
        """Every check a generating request passes before it runs, in this order, each once."""
        arrival_time = time.monotonic()
        body = route.body
        self.check_task(route.task)
        lora_request = self.check_model(body.model)
        params = await self.sampling_params(body, route.tool_constraint)
        priority = self.resolve_priority(body.priority, headers.priority)
        request_id, engine_suffix = _answer_id(route, headers, body.request_id)
        self.check_accepting(priority)
        safety = self.request_safety(priority)
        prompt = _truncated(await route.prompt(self, safety), await self.truncation(body, route.task))
        for token_ids, param in zip(prompt.token_ids, prompt.params, strict=True):
            self.check_prompt(token_ids, params, param)
        if params.structured_outputs is not None and route.opens_in_reasoning:
            # The constraint would hold from the first token, where the model reasons, not answers.
            param = "tools" if route.tool_constraint is not None else _constraint_param(body)
            raise BadRequestError(
                f"{param} constrains the answer, and this model reasons first: a constrained output needs "
                "the reasoning switched off (chat_template_kwargs, e.g. enable_thinking false)",
                param=param,
            )
        if body.kv_transfer_params is not None:
            check_kv_transfer_call(body.kv_transfer_params, body.stream, len(prompt.token_ids))
        resumed = self.check_continuation(body.continuation, prompt.token_ids, params)
        beam_searches = self._beam_searches(route, params, prompt.token_ids)
        if resumed and safety is not None and safety.checks_output:
            # Output checks read an answer from its start, which a continuation does not resend.
            raise BadRequestError(
                "a continuation cannot be served under this tier's output checks", param=CONTINUATION
            )
        checked_text = route.input_text(self, safety)
        if safety is not None and checked_text is not None:
            if safety.redacts_input:
                await safety.refuse_unredacted(checked_text)
            else:
                safety.start_input_check(checked_text)
        prepared = PreparedRequest(
            route=route,
            request_id=request_id,
            engine_suffix=engine_suffix,
            created=int(time.time()),
            model=lora_request.lora_name if lora_request is not None else body.model or self.model_name,
            prompt_token_ids=prompt.token_ids,
            params=params,
            priority=priority,
            timeout=body.timeout if body.timeout is not None else self.settings.request_timeout,
            arrival_time=arrival_time,
            lora_request=lora_request,
            safety=safety,
            mm_features=prompt.mm_features,
            cache_salt=body.cache_salt,
            resumed=resumed,
            beam_searches=beam_searches,
        )
        if self.settings.enable_log_requests:
            self._log_request(prepared)
        return prepared

    def _beam_searches(
        self, route: Route, params: SamplingParams, prompts: list[list[int]]
    ) -> list[BeamSearchParams]:
        """With use_beam_search, each prompt's search (to the room its context leaves, without max_tokens);
        none otherwise."""
        body = route.body
        if not body.use_beam_search:
            return []
        if params.structured_outputs is not None:
            param = "tools" if route.tool_constraint is not None else _constraint_param(body)
            raise BadRequestError(f"{param} is not taken with use_beam_search", param=param)
        return [body.beam_search_params(params, self._room(params, token_ids)) for token_ids in prompts]

    def _log_request(self, request: PreparedRequest) -> None:
        lora_name = request.lora_request.lora_name if request.lora_request is not None else None
        logger.info(
            "Received request %s: params: %s, lora: %s.", request.request_id, request.params, lora_name
        )
        if logger.isEnabledFor(logging.DEBUG):
            shown = [ids[: self.settings.max_log_len] for ids in request.prompt_token_ids]
            logger.debug("Request %s prompt_token_ids: %s", request.request_id, shown)

    def check_task(self, task: str) -> None:
        """A 404 for a route of what this server does not serve, as vLLM's server, which lacks the route."""
        if task in self.tasks:
            return
        config = self.engine.config
        served = "embeddings" if task == GENERATE else "generation"
        raise NotFoundError(
            f"this server serves {served} only (runner {config.runner}, convert {config.convert}): "
            f"{_TASK_ROUTES[task]} are not served"
        )

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request names as its model, or None for the served model itself."""
        served_names = self.settings.served_model_names
        if model is None or model in served_names:
            return None
        adapters = self.lora_adapters
        lora = adapters.get(model) if adapters is not None else None
        if lora is None:
            names = (
                [*served_names, *(served.lora.lora_name for served in adapters.loaded)]
                if adapters
                else served_names
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
        refusal = self.refusal()
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.record_rejected("draining", tier_of(priority))
            raise ServiceUnavailableError(refusal, code=DRAINING_CODE)
        if self.engine.error is not None:
            raise from_engine_error(self.engine.error)

    def resolve_priority(self, body_priority: int | str | None, header: str | None) -> int:
        """The body's field, else the priority header, else the service's default."""
        if body_priority is not None:
            source, value = "priority", body_priority
        elif header is not None:
            source, value = PRIORITY_HEADER, header
        else:
            return self.settings.default_priority
        try:
            priority = parse_priority(value)
        except ValueError as exc:
            raise BadRequestError(str(exc), param=source) from None
        allowed = self.settings.max_priority_tier
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
        guardrails = self.guardrails
        if guardrails is None:
            return None
        default_tier = tier_of(self.settings.default_priority)
        safety = RequestSafety(guardrails, guardrails.config.claimed_policy(tier_of(priority), default_tier))
        return safety if safety.checks_input or safety.checks_output else None

    async def sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The body's sampling parameters; `tool_constraint` is what tool_choice constrains the output to."""
        params = body.sampling_params(self.settings.default_sampling_params)
        max_n = self.settings.max_n
        if params.n > max_n:
            raise BadRequestError(f"n must be at most {max_n} on this server, got {params.n}", param="n")
        limit = self.settings.max_tokens_limit
        if limit is not None and (params.max_tokens is None or params.max_tokens > limit):
            params.max_tokens = limit
        max_logprobs = self.settings.max_logprobs
        logprobs_name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        for name, asked in ((logprobs_name, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is not None and asked > max_logprobs:
                raise BadRequestError(
                    f"{name} must be at most {max_logprobs} on this server, got {asked}", param=name
                )
        param = _constraint_param(body)
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

        await self.engine.run_tokenizer(work)

    async def truncation(
        self, body: CompletionRequest | ChatCompletionRequest, task: str
    ) -> Truncation | None:
        """What the request's truncate_prompt_tokens keeps of each prompt; a 400 past the context. Unless the
        request names a side, a prompt to generate from keeps its end, and one to pool its start (vLLM's
        sides, whatever the tokenizer's own)."""
        if body.truncate_prompt_tokens is None:
            return None
        engine = self.engine
        await engine.wait_ready(engine.startup_request_timeout)  # for the context
        max_model_len = self.engine_info.max_model_len
        if body.truncate_prompt_tokens > max_model_len:
            raise BadRequestError(
                f"truncate_prompt_tokens={body.truncate_prompt_tokens} is more than this model's maximum "
                f"context length of {max_model_len} tokens",
                param="truncate_prompt_tokens",
            )
        return body.truncation(max_model_len, "left" if task == GENERATE else "right")

    def check_prompt(self, token_ids: list[int], params: SamplingParams, param: str) -> None:
        """The prompt's length, token ids and sampling token ids, and the tokens it may generate."""
        info = self.engine_info
        try:
            check_prompt_token_ids(
                token_ids,
                params.stop_token_ids or [],
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                max_tokens=params.max_tokens,
            )
        except ContextLengthError as exc:
            raise context_length_error(exc, param) from None
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc), param=param) from None
        try:
            check_sampling_token_ids(params, vocab_size=info.vocab_size)
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc), param=str(exc).split(" ", 1)[0]) from None
        max_tokens = self._room(params, token_ids)
        limit = self.settings.max_completion_tokens_per_prompt
        if params.n * max_tokens > limit:
            budget = "max_tokens" if params.max_tokens is not None else "the room left (max_tokens unset)"
            raise BadRequestError(
                f"n x {budget} = {params.n} x {max_tokens} = {params.n * max_tokens} tokens to generate for "
                f"one prompt, more than this server's limit of {limit}; lower n or max_tokens",
                param="n" if params.n > 1 else "max_tokens",
            )

    def _room(self, params: SamplingParams, token_ids: list[int]) -> int:
        """The tokens a prompt may generate: max_tokens, else what its context leaves."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.engine_info.max_model_len - len(token_ids)

    def check_continuation(
        self, continuation: Continuation | None, prompts: list[list[int]], params: SamplingParams
    ) -> list[dict[int, ResumedSequence]]:
        """What a continuation's choices already delivered, per prompt and by sequence index (choice
        index = prompt index x n + sequence index); empty without one. The engine checks the rest: that
        each unfinished choice had not stopped, and its grammar accepts its tokens."""
        if continuation is None:
            return []
        info = self.engine_info
        n = params.n
        resumed: list[dict[int, ResumedSequence]] = [{} for _ in prompts]
        for choice in continuation.choices:
            index = choice.index
            if not 0 <= index < len(prompts) * n:
                raise BadRequestError(
                    f"continuation choice index {index} is not one of this request's "
                    f"{len(prompts) * n} choices",
                    param=CONTINUATION,
                )
            prompt_index, sequence_index = divmod(index, n)
            if sequence_index in resumed[prompt_index]:
                raise BadRequestError(f"continuation choice index {index} is given twice", param=CONTINUATION)
            try:
                check_resumed_token_ids(
                    choice.token_ids, vocab_size=info.vocab_size, max_tokens=params.max_tokens
                )
            except InvalidRequestError as exc:
                raise BadRequestError(f"continuation choice {index}: {exc}", param=CONTINUATION) from None
            num_tokens = len(prompts[prompt_index]) + len(choice.token_ids)
            if num_tokens > info.max_model_len:
                raise BadRequestError(
                    f"continuation choice {index}: the prompt and its resumed tokens are {num_tokens} "
                    f"tokens, more than the model's context (max_model_len) of {info.max_model_len}",
                    param=CONTINUATION,
                    code=CONTEXT_LENGTH_EXCEEDED,
                )
            resumed[prompt_index][sequence_index] = ResumedSequence(list(choice.token_ids), choice.finished)
        return resumed

    # ---- tokenizing (off the event loop) ---------------------------------------------------------

    async def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        param: str = "prompt",
        truncation: Truncation | None = None,
        content_tokens: int = 0,
    ) -> list[int]:
        """Token ids of a text that the model's context could hold: with `content_tokens`, its first that many
        tokens before the special ones are added (vLLM's max_tokens_per_query and _doc). A text beyond the
        context is refused unread, unless `content_tokens` or `truncation` keep only some of its first or
        last tokens: then only the start or end of it that holds them is read."""

        def work(tokenizer: Any) -> list[int]:
            window = text
            if self._beyond_context(tokenizer, len(text)):
                kept = content_tokens or (truncation.keep if truncation is not None else None)
                if kept is None:
                    self._refuse_beyond_context(tokenizer, len(text), param)
                # Those tokens and a margin come from at most this many characters; how the text is cut
                # changes only the tokens at the cut, which the margin keeps away from those kept.
                width = 2 * longest_token_characters(tokenizer) * (kept + _TRUNCATION_MARGIN_TOKENS)
                from_end = not content_tokens and truncation is not None and truncation.side == "left"
                window = text[-width:] if from_end else text[:width]
            backend = tokenizer.backend_tokenizer
            around = truncation is not None and truncation.around_special_tokens and add_special_tokens
            # The batch call releases the interpreter lock while it encodes; the single-text one does not.
            if not (content_tokens or around):
                return backend.encode_batch([window], add_special_tokens=add_special_tokens)[0].ids
            (encoding,) = backend.encode_batch([window], add_special_tokens=False)
            if content_tokens:
                encoding.truncate(content_tokens)
            else:
                assert truncation is not None
                specials = backend.num_special_tokens_to_add(is_pair=False)
                if truncation.keep < specials:
                    raise BadRequestError(
                        f"truncate_prompt_tokens={truncation.keep} is fewer than the special tokens this "
                        f"model's tokenizer adds to a text ({specials})",
                        param="truncate_prompt_tokens",
                    )
                encoding.truncate(truncation.keep - specials, direction=truncation.side)
            return backend.post_process(encoding, add_special_tokens=add_special_tokens).ids

        return await self.engine.run_tokenizer(work)

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[int]:
        """The prompt of a conversation (and the tools it may call), rendered with the template variables
        of `template_kwargs` (by the request's `chat_template` where the server trusts one) and tokenized;
        with `continue_final_message`, open at the last message's end."""
        if chat_template is not None and not self.settings.trust_request_chat_template:
            raise BadRequestError(
                "a request's chat_template is rendered only by a server started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        conversation = template_messages(messages)
        characters = sum(len(text) for text in text_fields([conversation, tools, template_kwargs]))

        def work(tokenizer: Any) -> list[int]:
            self._refuse_beyond_context(tokenizer, characters, "messages")
            reserved = sorted(rendering_parameters(tokenizer).intersection(template_kwargs or {}))
            if reserved:
                raise BadRequestError(
                    f"chat_template_kwargs may not set {reserved[0]!r}: it is a parameter of the rendering, "
                    "not a variable of the template",
                    param="chat_template_kwargs",
                )
            try:
                return chat_prompt_token_ids(
                    tokenizer,
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    template_kwargs=template_kwargs,
                    continue_final_message=continue_final_message,
                    content_format=self.settings.chat_template_content_format,
                    chat_template=chat_template,
                )
            except ValueError as exc:
                raise BadRequestError(str(exc), param="messages") from None

        return await self.engine.run_tokenizer(work)

    async def prompt_text(self, token_ids: list[int]) -> str:
        """A prompt's text as the model reads it."""
        return await self.engine.run_tokenizer(lambda tokenizer: prompt_text(tokenizer, token_ids))

    def _beyond_context(self, tokenizer: Any, characters: int) -> bool:
        """Whether a text is longer than the whole context could hold even in the vocabulary's longest tokens
        (twice over, for normalizers that shorten text)."""
        return characters > 2 * longest_token_characters(tokenizer) * self.engine_info.max_model_len

    def _refuse_beyond_context(self, tokenizer: Any, characters: int, param: str) -> None:
        """Refuse a text beyond the context without tokenizing it. Tokenizing millions of tokens would take
        seconds only to refuse them, and building their list would hold the interpreter lock, and so the
        event loop, all that time."""
        max_model_len = self.engine_info.max_model_len
        if self._beyond_context(tokenizer, characters):
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the {param} has "
                f"{characters} characters, more than that many tokens can hold",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        self.check_model(body.model)
        if body.messages is not None:
            param = "messages"
            token_ids = await self.chat_prompt(
                body.messages,
                body.add_generation_prompt,
                template_kwargs=self.settings.chat_rendering.template_kwargs(body.chat_template_kwargs),
                continue_final_message=body.continue_final_message,
                chat_template=body.chat_template,
            )
        else:
            param = "prompt"
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = await self.encode(body.prompt, add_special_tokens=add_special)
        max_model_len = self.engine_info.max_model_len
        try:
            check_context_length(len(token_ids), max_model_len, num_output_tokens=0)
        except ContextLengthError as exc:
            raise context_length_error(exc, param) from None
        answer: dict[str, Any] = {
            "count": len(token_ids),
            "max_model_len": max_model_len,
            "tokens": token_ids,
        }
        if body.return_token_strs:
            answer["token_strs"] = self.tokenizer.convert_ids_to_tokens(token_ids)
        return answer

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        await self.engine.wait_ready(self.engine.startup_request_timeout)
        vocab_size = self.engine_info.vocab_size
        bad = [token for token in body.tokens if not 0 <= token < vocab_size]
        if bad:
            raise BadRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        text = await self.engine.run_tokenizer(lambda tokenizer: tokenizer.decode(body.tokens))
        return {"prompt": text}

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """One card per name the model is served by."""
        return [self._model_card(name, created) for name in self.settings.served_model_names]

    def _model_card(self, name: str, created: int) -> dict[str, Any]:
        info = self.engine.info
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kvfleet",
            # vLLM's fields; never the model's path on disk, which clients have no business knowing.
            "root": name,
            "parent": None,
            "max_model_len": info.max_model_len if info is not None else None,
            # kvfleet's addition: what `kvfleet bench serve` draws random token-id prompts from.
            "vocab_size": info.vocab_size if info is not None else None,
        }

    # ---- running ---------------------------------------------------------------------------------

    def outputs(self, request: PreparedRequest, *, stream: bool = False) -> AsyncIterator[RequestOutput]:
        """The delta outputs of every prompt of the request, in arrival order; behind the request's input
        check, when streamed its output checked window by window, and logged where the server logs outputs."""
        streams = []
        for index, (request_id, token_ids) in enumerate(
            zip(request.engine_request_ids, request.prompt_token_ids, strict=True)
        ):
            options: dict[str, Any] = {
                "priority": request.priority,
                "timeout": request.timeout,
                "arrival_time": request.arrival_time,
                "lora_request": request.lora_request,
                "mm_features": request.mm_features[index] if request.mm_features else None,
                "cache_salt": request.cache_salt,
            }
            if request.beam_searches:
                search = request.beam_searches[index]
                with_logprobs = request.params.logprobs is not None
                streams.append(
                    beam_search_outputs(
                        self.engine, request_id, token_ids, search, with_logprobs=with_logprobs, **options
                    )
                )
                continue
            resumed = request.resumed[index] if request.resumed else None
            streams.append(
                self.engine.generate(request_id, token_ids, request.params, **options, resumed=resumed)
            )
        outputs = streams[0] if len(streams) == 1 else merge_streams(streams)
        safety = request.safety
        if safety is not None:
            outputs = safety.after_input_check(outputs)
            if stream and safety.checks_output:
                outputs = safety.output_windows(outputs, request.engine_request_ids, request.params.n)
        settings = self.settings
        if settings.enable_log_outputs:
            outputs = logged_outputs(
                outputs, streamed=stream, deltas=settings.enable_log_deltas, max_log_len=settings.max_log_len
            )
        return outputs

    async def complete(self, request: PreparedRequest) -> dict[str, Any]:
        """Runs the request to its end: the response body. Cancelling the call aborts the request."""
        choices = [[Choice() for _ in range(request.params.n)] for _ in request.prompt_token_ids]
        kv_transfer_params = None
        cached = _CachedTokens()
        async with contextlib.aclosing(self.outputs(request)) as outputs:
            async for output in outputs:
                cached.add(output)
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                per_prompt = choices[request.prompt_index[output.request_id]]
                for completion in output.outputs:
                    per_prompt[completion.index].add(completion)
                if output.prompt_logprobs is not None:
                    for choice in per_prompt:
                        choice.prompt_logprobs = output.prompt_logprobs
        every_choice = [choice for per_prompt in choices for choice in per_prompt]
        for choice in every_choice:
            error = finish_error(choice.finish_reason)
            if error is not None:
                raise error
        if request.safety is not None and request.safety.checks_output:
            await _check_outputs(request.safety, every_choice)
        response = request.route.response(
            request, choices, self.tokenizer, self._cached_tokens(request, cached)
        )
        if kv_transfer_params is not None:
            # vLLM's: a prefill call's answer says where its KV waits, for the decode call.
            response[KV_TRANSFER_PARAMS] = kv_transfer_params
        return response

    async def stream(self, request: PreparedRequest) -> AsyncIterator[dict[str, Any]]:
        """The request's chunks, returned once its first output is in, so that a request shed, timed out or
        refused while queued fails here, before a stream is committed to (a continuation's output resumed
        from another replica does not count: its grammar is checked when compiled, before its first
        output). The chunks raise the error that ends a failed request early."""
        outputs = self.outputs(request, stream=True)
        resumed: list[RequestOutput] = []
        first = await _first_generated(outputs, resumed)
        failure = None if first is None else _failure_before_any_token(first)
        if failure is not None:
            await outputs.aclose()  # type: ignore[attr-defined]
            raise failure
        return self._chunks(request, outputs, first, resumed)

    async def _chunks(
        self,
        request: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        first: RequestOutput | None,
        resumed: list[RequestOutput],
    ) -> AsyncIterator[dict[str, Any]]:
        """The route's preamble (none for a continuation: the client has it), then the choices its builder
        makes of each delta (the last one's finish and stop reasons set here), then the usage when asked
        for. A continuation's builder first catches up on what its choices delivered, and what it makes of
        that is dropped: it was sent by the replica before (a tool call's announcement, say)."""
        route = request.route
        prompt_logprobs: dict[int, list[PromptTokenLogprobs | None]] = {}
        choice_of = route.choice_builder(request, self.tokenizer, prompt_logprobs)
        # Each choice's tokens so far, by its prompt's index and its own.
        generated: Counter[tuple[int, int]] = Counter()
        cached = _CachedTokens()
        for output in resumed:
            prompt_index = request.prompt_index[output.request_id]
            for completion in output.outputs:
                generated[prompt_index, completion.index] += len(completion.token_ids)
                # A choice that delivered nothing was sent nothing (a completion's echo, say).
                if completion.token_ids and not completion.finished:
                    choice_of(prompt_index, completion, False)
        force_usage = self.settings.enable_force_include_usage
        # vLLM's continuous usage: each chunk with its choice's usage so far.
        continuous = route.body.continuous_usage or force_usage

        def sent(choice: dict[str, Any], prompt_index: int, sequence_index: int) -> dict[str, Any]:
            if not continuous:
                return chunk(request, choice)
            prompt_tokens = len(request.prompt_token_ids[prompt_index])
            return chunk(request, choice, usage(prompt_tokens, generated[prompt_index, sequence_index]))

        def chunks_of(output: RequestOutput) -> Iterator[dict[str, Any]]:
            cached.add(output)
            prompt_index = request.prompt_index[output.request_id]
            if output.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = output.prompt_logprobs
            for completion in output.outputs:
                generated[prompt_index, completion.index] += len(completion.token_ids)
                error = finish_error(completion.finish_reason)
                finished = error is None and completion.finish_reason is not None
                choices = choice_of(prompt_index, completion, finished)
                for number, choice in enumerate(choices, start=1):
                    # The last choice finishes; a builder may name its own reason (tool calls).
                    reasons: dict[str, Any] = {"finish_reason": None}
                    if finished and number == len(choices):
                        reasons = {
                            "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason,
                        }
                    yield sent({**reasons, **choice}, prompt_index, completion.index)
                if error is not None:
                    raise error

        async with contextlib.aclosing(outputs):
            for number, choice in enumerate(route.preamble(request) if not request.resumed else []):
                body = sent(choice, 0, choice["index"])
                yield {**body, **route.first_chunk_fields(request)} if number == 0 else body
            if first is not None:
                for body in chunks_of(first):
                    yield body
                async for output in outputs:
                    for body in chunks_of(output):
                        yield body
        if route.body.include_usage or force_usage:
            prompt_tokens = sum(len(ids) for ids in request.prompt_token_ids)
            completion_tokens = sum(generated.values())
            yield chunk(
                request, None, usage(prompt_tokens, completion_tokens, self._cached_tokens(request, cached))
            )

    def _cached_tokens(self, request: PreparedRequest, cached: _CachedTokens) -> int | None:
        """The prompt tokens the prefix cache held, where the usage reports them."""
        if request.route.reports_cached_tokens or self.settings.enable_prompt_tokens_details:
            return cached.total
        return None


class _CachedTokens:
    """The prompt tokens the prefix cache held, summed over a request's prompts (each prompt's engine
    request reports its own count with its outputs)."""

    def __init__(self) -> None:
        self._by_prompt: dict[str, int] = {}

    def add(self, output: RequestOutput) -> None:
        held = self._by_prompt.get(output.request_id, 0)
        self._by_prompt[output.request_id] = max(held, output.num_cached_tokens)

    @property
    def total(self) -> int:
        return sum(self._by_prompt.values())


async def _first_generated(
    outputs: AsyncIterator[RequestOutput], resumed: list[RequestOutput]
) -> RequestOutput | None:
    """The first output generated here (None if there is none); a continuation's resumed outputs before it
    go to `resumed`."""
    async for output in outputs:
        if not output.resumed:
            return output
        resumed.append(output)
    return None


def _failure_before_any_token(output: RequestOutput) -> OpenAIError | None:
    """The error of a first output that ends its request without a token (a timeout in the queue)."""
    if any(completion.token_ids for completion in output.outputs):
        return None
    return next(filter(None, (finish_error(completion.finish_reason) for completion in output.outputs)), None)


def _constraint_param(body: CompletionRequest | ChatCompletionRequest) -> str:
    """The field that constrains the output: structured_outputs, or response_format."""
    return "structured_outputs" if body.structured_outputs else "response_format"


def check_kv_transfer_call(kv_transfer_params: dict[str, Any], stream: bool, num_prompts: int) -> None:
    """Raises BadRequestError for kv_transfer_params that are malformed, or that ask a prefill replica to
    stream (its answer's params would be lost) or name one prompt's blocks for several prompts. The replica's
    engine checks the rest (its role, n, the block count, the peer)."""
    try:
        call = parse_kv_transfer_params(kv_transfer_params)
    except InvalidRequestError as error:
        raise BadRequestError(str(error), param=KV_TRANSFER_PARAMS) from None
    if call is None:
        return
    if num_prompts > 1:
        raise BadRequestError("kv_transfer_params: a disaggregated request has one prompt", param="prompt")
    if isinstance(call, RemoteDecode) and stream:
        raise BadRequestError(
            f"kv_transfer_params.{DO_REMOTE_DECODE}: a prefill call is not streamed (its answer carries the "
            "kv_transfer_params of the decode call)",
            param="stream",
        )


def context_length_error(error: ContextLengthError, param: str) -> BadRequestError:
    """OpenAI's answer to a prompt that does not fit: the output asked for is blamed when the prompt alone
    would have."""
    max_model_len, prompt_tokens, output_tokens = (
        error.max_model_len,
        error.num_prompt_tokens,
        error.num_output_tokens,
    )
    if error.output_too_long:
        return BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but "
            f"{prompt_tokens + output_tokens} were requested ({prompt_tokens} in the prompt, {output_tokens} "
            "for the completion); lower max_tokens or shorten the prompt",
            param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    # The prompt leaves no room for output; or (tokenizing only) the text has more tokens than the context.
    counted = "the prompt" if output_tokens else f"the {param}"
    room = ", leaving no room for output" if output_tokens else ""
    return BadRequestError(
        f"This model's maximum context length is {max_model_len} tokens, but {counted} has {prompt_tokens} "
        f"tokens{room}",
        param=param,
        code=CONTEXT_LENGTH_EXCEEDED,
    )


async def _check_outputs(safety: RequestSafety, choices: list[Choice]) -> None:
    """Whole answers checked at once: a blocked one becomes the refusal, finished by content_filter; what is
    sent of their tokens follows their text."""
    checked = await asyncio.gather(*(safety.checked_text(choice.text) for choice in choices))
    for choice, (text, blocked) in zip(choices, checked, strict=True):
        choice.token_ids, choice.logprobs = sent_tokens(
            choice.token_ids, choice.logprobs, blocked=blocked, redacted=text != choice.text
        )
        choice.text = text
        if blocked:
            choice.finish_reason = CONTENT_FILTER


def _answer_id(route: Route, headers: RequestHeaders, body_id: str | None) -> tuple[str, str]:
    """The answer's id, and its engine requests' suffix. vLLM's: an id the client chose (X-Request-Id, else
    the body's request_id) after the route's prefix, or the body's as it is where the route keeps it; two
    requests in flight may share it, so their engine requests get a suffix of their own. Else a new one."""
    chosen = body_id if route.keeps_request_id else headers.chosen_id(body_id)
    if chosen is None:
        return f"{route.id_prefix}-{uuid.uuid4().hex}", ""
    answer_id = chosen if route.keeps_request_id else f"{route.id_prefix}-{chosen}"
    return answer_id, f"-{uuid.uuid4().hex[:8]}"


def _truncated(prompt: Prompt, truncation: Truncation | None) -> Prompt:
    """The prompts cut as the request's truncate_prompt_tokens asks (vLLM's)."""
    if truncation is None:
        return prompt
    token_ids = []
    for index, ids in enumerate(prompt.token_ids):
        cut = truncation.cut(ids)
        if cut != ids and prompt.mm_features and prompt.mm_features[index]:
            raise BadRequestError(
                f"truncate_prompt_tokens would cut {prompt.params[index]}, whose images, audio or "
                "embeddings must stay whole; keep more tokens or send less",
                param="truncate_prompt_tokens",
            )
        token_ids.append(cut)
    return dataclasses.replace(prompt, token_ids=token_ids)
