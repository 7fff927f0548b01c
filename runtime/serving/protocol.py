"""Request bodies of the OpenAI API (plus vLLM's sampling extras), and their translation to SamplingParams.

Types are strict: a boolean or a float is not an integer, a number is not a boolean, floats are finite
(Python's JSON parser accepts Infinity and NaN), and integers stay allowed where a float is expected (clients
send `temperature: 1`). Text must be valid Unicode: JSON's \\ud800 escapes can carry lone surrogates, which no
tokenizer or encoder takes.

Fields that change nothing here (`store`, `metadata`, `user`, ...) are accepted and ignored. Fields that
would change the output but are not implemented are refused, never silently dropped: UNSUPPORTED_FIELDS.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from kvfleet.contract.errors import BadRequestError
from kvfleet.contract.request_ids import REQUEST_ID_PATTERN
from kvfleet.contract.resume import CONTINUATION
from kvfleet.contract.scoring import score_sides
from kvfleet.runtime import json_depth
from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.input_checks import check_cache_salt
from kvfleet.runtime.pooler_config import score_pairs
from kvfleet.runtime.sampling_params import (
    KV_TRANSFER_PARAMS,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]
# vLLM's request_id (and its X-Request-Id header): the base of an answer's id.
RequestId = Annotated[str, Field(pattern=f"^{REQUEST_ID_PATTERN}$")]

# Output-changing fields a client may send (OpenAI's and vLLM's) that are not implemented, with the values
# that leave the output as it is. A request model that implements one declares it as a field, which takes it
# off this list for that route.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "suffix": (None, ""),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "top_logprobs": (None, 0),
    "max_completion_tokens": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    # vLLM
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structural_tag": (None,),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_strs": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    # Implemented on /v1/chat/completions only.
    "include_reasoning": (None, True),
    "watermarking": (None, False),
    "logprob_token_ids": (None, []),
    "media_io_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "return_token_offsets": (None, False),
    "return_prompt_text": (None, False),
    "repetition_detection": (None,),
    "vllm_xargs": (None, {}),
    # Implemented on /v1/chat/completions only (and the last on /tokenize).
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "continue_final_message": (None, False),
}


def _lone_surrogate(value: Any) -> str | None:
    """Where in `value` (text, or lists and dicts holding text) a lone surrogate is: '' for the value
    itself, a path like '[2]' or '.key' below it, None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ""
        return None
    if isinstance(value, list):
        items = [(f"[{index}]", item) for index, item in enumerate(value)]
    elif isinstance(value, dict):
        items = [(".<key>", key) for key in value] + [(f".{key}", item) for key, item in value.items()]
    else:
        return None
    for where, item in items:
        below = _lone_surrogate(item)
        if below is not None:
            return where + below
    return None


class Body(BaseModel):
    """A body or a part of one: unknown fields are ignored, and text must be valid Unicode."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        where = _lone_surrogate(value)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "must be valid Unicode text, but holds a lone surrogate{where}",
                {"where": f" at {where}" if where else ""},
            )
        return value


class RequestBody(Body):
    """A route's body: unknown fields are kept, so that unsupported ones can be refused."""

    model_config = ConfigDict(extra="allow")

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            inert = UNSUPPORTED_FIELDS.get(name)
            if inert is not None and value not in inert:
                raise BadRequestError(f"{name} is not supported on this endpoint", param=name)


class StreamOptions(Body):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far too.
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(Body):
    model_config = ConfigDict(populate_by_name=True)

    name: str
    description: str | None = None
    # Aliased: `schema` is a BaseModel method.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag type: xgrammar's `format`, or vLLM's older `structures` and `triggers`
    # (StructuredOutputsParams.structural_tag).
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> str:
        """The structural tag this response format is, as JSON text."""
        tag = {"type": "structural_tag", "format": self.format}
        if self.format is None:
            tag = {"type": "structural_tag", "structures": self.structures, "triggers": self.triggers}
        return json.dumps(tag)


class StructuredOutputsBody(Body):
    """vLLM's `structured_outputs` field: exactly one of these."""

    model_config = ConfigDict(populate_by_name=True)

    # Aliased: `json` is a BaseModel method.
    json_value: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: str | None = None


class ContinuationChoice(Body):
    """A choice a continuation resumes: its OpenAI index, the output tokens it already delivered, and
    whether it already finished (kvfleet.contract.resume)."""

    index: StrictInt
    token_ids: list[StrictInt]
    finished: StrictBool = False


class Continuation(Body):
    choices: list[ContinuationChoice]


Side = Literal["left", "right"]


@dataclass(frozen=True)
class Truncation:
    """A prompt cut to its last (left side) or first (right side) `keep` tokens. Where the request names no
    side, the cut is vLLM's tokenizer's: a text's special tokens (a beginning-of-text token, BERT's [CLS] and
    [SEP]) stay, and its own tokens are cut to fit beside them (`around_special_tokens`, which the service
    encodes such a text by)."""

    keep: int
    side: Side
    around_special_tokens: bool = False

    def cut(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.keep:
            return token_ids
        return token_ids[len(token_ids) - self.keep :] if self.side == "left" else token_ids[: self.keep]


class _GenerationRequest(RequestBody):
    model: str | None = None
    n: StrictInt = 1
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    seed: StrictInt | None = None
    user: str | None = None
    # vLLM's: the base of the answer's id (`chatcmpl-<request_id>`), where no X-Request-Id header gives one.
    request_id: RequestId | None = None
    # vLLM's extras.
    top_k: StrictInt | None = None
    min_p: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # kvfleet's: an SLA tier name or its integer (lower = served first), and a deadline in seconds.
    priority: StrictInt | str | None = None
    timeout: Annotated[FiniteFloat, Field(gt=0)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # OpenAI's: token ids as strings (JSON object keys).
    logit_bias: dict[str, FiniteFloat] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    # vLLM's disaggregated prefill and decode: {"do_remote_decode": true} asks a prefill replica to keep the
    # prompt's KV for a decode replica; the params its answer carries ask a decode replica to pull it.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the prompt's and each choice's token ids in the answer (streamed: each chunk's new ones).
    return_token_ids: StrictBool | None = None
    # vLLM's: logprobs name each token "token_id:N" instead of by its text, which may be a fragment of a
    # character JSON cannot carry; by default the server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: StrictBool | None = None
    # vLLM's: a tenant's salt; prompts share prefix-cache blocks only with prompts of the same salt.
    cache_salt: str | None = None
    # vLLM's: each prompt cut to this many tokens (-1: what the context holds beside one token to generate),
    # its last ones kept (truncation_side "left") or its first ("right"; by default the tokenizer's side).
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Side | None = None
    # vLLM's: streamed tokens handed out this many at a time (the first and the last at once).
    stream_interval: StrictInt | None = None
    # vLLM's: the most tokens the model's reasoning may take, its end written once they are spent (-1: no
    # limit); served where the engine has a reasoning parser or --reasoning-config.
    thinking_token_budget: StrictInt | None = None
    # vLLM's: each prompt token's log probability after the first, with this many of the likeliest tokens in
    # its place and their ranks (answered whole: not with stream).
    prompt_logprobs: StrictInt | None = None
    # kvfleet's: the request resumed from what its choices already delivered, mid-stream, by a replica that
    # failed or handed it back (kvfleet.contract.resume).
    continuation: Continuation | None = None
    # vLLM's beam search: n beams, searched by the model's logprobs (kvfleet.runtime.engine.beam_search) and
    # answered whole once the search ends, ranked by their logprob over their length to the power
    # length_penalty.
    use_beam_search: StrictBool = False
    length_penalty: FiniteFloat = 1.0

    def truncation(self, max_model_len: int, default_side: Side) -> Truncation | None:
        """What truncate_prompt_tokens keeps of each prompt (vLLM's): that many tokens, its last on the "left"
        side and its first on the "right" (truncation_side, else `default_side`, the task's, around a text's
        special tokens); -1 keeps what max_model_len holds beside one token to generate. None where it keeps
        all."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        return Truncation(
            max_model_len - 1 if keep == -1 else keep,
            self.truncation_side or default_side,
            around_special_tokens=self.truncation_side is None,
        )

    def truncated(self, token_ids: list[int]) -> list[int] | None:
        """A prompt as truncate_prompt_tokens cuts it, as far as the request alone says: None where the cut
        needs the model's context (-1) or, with no truncation_side, its tokenizer's special tokens."""
        keep = self.truncate_prompt_tokens
        if keep is None or len(token_ids) <= keep:
            return token_ids
        if keep == -1 or self.truncation_side is None:
            return None
        return Truncation(keep, self.truncation_side).cut(token_ids)

    def tokens_as_ids(self, default: bool) -> bool:
        """Whether logprobs name tokens "token_id:N": the request's choice, else the server's."""
        return default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def _check_common(self) -> None:
        self.refuse_unsupported()
        if self.cache_salt is not None:
            try:
                check_cache_salt(self.cache_salt)
            except InvalidRequestError as error:
                raise BadRequestError(str(error), param="cache_salt") from None
        if self.stream_options is not None and not self.stream:
            raise BadRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if self.continuation is not None and not self.stream:
            raise BadRequestError(
                "a continuation resumes a stream: it is only allowed when stream is true", param=CONTINUATION
            )
        if self.stream and self.prompt_logprobs not in (None, 0):
            raise BadRequestError(
                "prompt_logprobs are not available when stream is true (0, which asks for no alternatives, "
                "is taken and sends nothing, as in vLLM)",
                param="prompt_logprobs",
            )

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any] | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """`defaults` (SamplingParams fields) stand in for the fields the body leaves unset;
        `prompt_logprobs`: the request's, where the route reads them from more than its field."""
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "prompt_logprobs": self._prompt_logprobs() if prompt_logprobs is None else prompt_logprobs,
            "structured_outputs": self._structured_outputs(),
            "logit_bias": self._logit_bias(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "stream_interval": self.stream_interval,
            "thinking_token_budget": self.thinking_token_budget,
            "extra_args": None
            if self.kv_transfer_params is None
            else {KV_TRANSFER_PARAMS: self.kv_transfer_params},
        }
        # Absent fields take the server's defaults, else SamplingParams' (which are OpenAI's).
        server_defaults = dict(defaults or {})
        if max_tokens is None:
            max_tokens = server_defaults.get("max_tokens")
        server_defaults.pop("max_tokens", None)
        kwargs = {**server_defaults, **{name: value for name, value in given.items() if value is not None}}
        try:
            return SamplingParams(max_tokens=max_tokens, **kwargs)
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0]
            raise BadRequestError(
                message, param=param if param in given or param == "max_tokens" else None
            ) from None

    def beam_search_params(self, params: SamplingParams, max_tokens: int) -> BeamSearchParams:
        """The search use_beam_search asks for, of `params` (the body's) and `max_tokens` for its prompt.
        Refuses what the search would not honour: its steps read only the model's logprobs."""
        ignored = [
            name
            for name, value, neutral in (
                ("stop", self.stop, (None, [])),
                ("stop_token_ids", self.stop_token_ids, (None, [])),
                ("min_tokens", self.min_tokens, (0,)),
                ("logit_bias", self.logit_bias, (None, {})),
                ("allowed_token_ids", self.allowed_token_ids, (None,)),
                ("bad_words", self.bad_words, (None, [])),
                ("presence_penalty", self.presence_penalty, (None, 0.0)),
                ("frequency_penalty", self.frequency_penalty, (None, 0.0)),
                ("repetition_penalty", self.repetition_penalty, (None, 1.0)),
                ("prompt_logprobs", self.prompt_logprobs, (None,)),
                ("thinking_token_budget", self.thinking_token_budget, (None, -1)),
            )
            if value not in neutral
        ]
        if ignored:
            raise BadRequestError(
                f"{ignored[0]} is not taken with use_beam_search: the beams are searched by the model's "
                "logprobs alone",
                param=ignored[0],
            )
        for name, value in ((CONTINUATION, self.continuation), (KV_TRANSFER_PARAMS, self.kv_transfer_params)):
            if value is not None:
                raise BadRequestError(
                    f"{name} is not taken with use_beam_search: a search is answered whole, by one replica",
                    param=name,
                )
        if params.prompt_logprobs is not None:
            # Asked for by echo with logprobs: the prompt is not scored by the search's steps.
            raise BadRequestError("echo with logprobs is not taken with use_beam_search", param="echo")
        if params.logprobs is not None and params.logprobs > 2 * params.n:
            raise BadRequestError(
                f"logprobs with use_beam_search: at most 2 x n = {2 * params.n}, the candidates each step "
                f"scores, got {params.logprobs}",
                param="logprobs",
            )
        try:
            return BeamSearchParams(
                beam_width=params.n,
                max_tokens=max_tokens,
                ignore_eos=params.ignore_eos,
                length_penalty=self.length_penalty,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        except ValueError as error:
            raise BadRequestError(f"n with use_beam_search: {error}", param="n") from None

    def _prompt_logprobs(self) -> int | None:
        """The prompt logprobs to score: none for a stream, which has no field to send them in."""
        return None if self.stream else self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise BadRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of `response_format` or `structured_outputs` (not both), shape-checked; whether
        its schema, regex or grammar is valid is checked later, off the event loop."""
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            if self.structured_outputs is not None:
                raise BadRequestError(
                    "give either response_format or structured_outputs, not both", param="response_format"
                )
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if response_format.type == "structural_tag":
                return StructuredOutputsParams(structural_tag=response_format.structural_tag())
            if response_format.json_schema is None or response_format.json_schema.json_schema is None:
                raise BadRequestError(
                    "response_format of type json_schema needs json_schema.schema",
                    param="response_format.json_schema",
                )
            return StructuredOutputsParams(json=response_format.json_schema.json_schema)
        body = self.structured_outputs
        if body is None:
            return None
        try:
            return StructuredOutputsParams(
                json=body.json_value,
                regex=body.regex,
                choice=body.choice,
                grammar=body.grammar,
                json_object=body.json_object,
                structural_tag=body.structural_tag,
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), param="structured_outputs") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    # vLLM's (with --enable-prompt-embeds): prompts given as their input embeddings, each base64 of what
    # torch.save writes of a tensor [tokens, hidden size]; run before the prompts of `prompt`.
    prompt_embeds: str | list[str] | None = None
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    add_special_tokens: StrictBool = True

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequestError("best_of different from n is not supported", param="best_of")
        prompt_logprobs = None
        if self.echo and self.logprobs is not None:
            # The echoed prompt's tokens come with their logprobs too, as in vLLM (streamed, in each choice's
            # first chunk).
            prompt_logprobs = max(self.logprobs, self._prompt_logprobs() or 0)
        if self.max_tokens == 0 and not self.echo:
            raise BadRequestError(
                "max_tokens must be at least 1, got 0 (0 is taken with echo, which answers the prompt alone)",
                param="max_tokens",
            )
        # OpenAI's and vLLM's echo of the prompt alone: the engine runs it for a token, which is not answered.
        max_tokens = 1 if self.echoes_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, defaults, prompt_logprobs)

    @property
    def echoes_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (with its logprobs, where asked), nothing more."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts of `prompt` (none where only prompt_embeds are given)."""
        if self.prompt is None or (self.prompt == "" and self.embedded_prompts()):
            if not self.embedded_prompts():
                raise BadRequestError("prompt or prompt_embeds must be given", param="prompt")
            return []
        return split_prompts(self.prompt, "prompt")

    def embedded_prompts(self) -> list[str]:
        """The base64 texts of prompt_embeds."""
        if self.prompt_embeds is None:
            return []
        return [self.prompt_embeds] if isinstance(self.prompt_embeds, str) else list(self.prompt_embeds)


def split_prompts(value: str | list[str] | list[int] | list[list[int]], param: str) -> list[str | list[int]]:
    """One entry per prompt: a batch of strings or of token lists is split, a token list kept whole."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequestError(f"{param} must not be empty", param=param)
    if all(isinstance(item, int) for item in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings request (plus kvfleet's priority and timeout, and vLLM's add_special_tokens,
    use_activation, prompt truncation, conversations and encodings)."""

    # vLLM's: also a conversation, or a list of them, as `messages` takes them.
    input: (
        str
        | list[str]
        | list[StrictInt]
        | list[list[StrictInt]]
        | list[ChatMessage]
        | list[list[ChatMessage]]
        | None
    ) = None
    # vLLM's: a conversation, or a list of them, embedded as the chat template renders it.
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    encoding_format: EncodingFormat = "float"
    # vLLM's: how base64 and bytes write the values (see embedding_encoding).
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    # A Matryoshka model's embeddings cut to this size (others refuse it).
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's, as on completions: the base of the answer's id.
    request_id: RequestId | None = None
    add_special_tokens: StrictBool = True
    # vLLM's: L2-normalized or not; by default as the server's pooler config says.
    use_activation: StrictBool | None = None
    # vLLM's, as on completions.
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: StrictInt | str | None = None
    timeout: Annotated[FiniteFloat, Field(gt=0)] | None = None

    def check(self) -> None:
        self.refuse_unsupported()
        if self.input is not None and self.messages is not None:
            raise BadRequestError("give input or messages, not both", param="messages")
        if self.conversations() is None:
            if self.input is None:
                raise BadRequestError("input or messages is required", param="input")
            split_prompts(self.input, "input")  # type: ignore[arg-type]
            return
        if self.add_special_tokens and "add_special_tokens" in self.model_fields_set:
            raise BadRequestError(
                "a conversation's special tokens are the chat template's to write", param="add_special_tokens"
            )
        check_conversation_end(self.add_generation_prompt, self.continue_final_message)

    def conversations(self) -> list[list[ChatMessage]] | None:
        """The conversations to embed (of messages, or of an input of messages); None for text or tokens."""
        value = self.messages if self.messages is not None else self.input
        if not isinstance(value, list) or not value:
            return None
        if all(isinstance(message, ChatMessage) for message in value):
            return [value]  # type: ignore[list-item]
        if all(isinstance(item, list) and item and isinstance(item[0], ChatMessage) for item in value):
            return value  # type: ignore[return-value]
        return None

    def chat_requests(self) -> list[ChatCompletionRequest]:
        """A chat request per conversation, run for its prompt's hidden states: one token each."""
        return [
            ChatCompletionRequest(
                messages=conversation,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                chat_template=self.chat_template,
                chat_template_kwargs=self.chat_template_kwargs,
                **_pooled_run(self),
            )
            for conversation in self.conversations() or []
        ]

    def completion_request(self) -> CompletionRequest:
        assert self.input is not None and self.conversations() is None, "text or token input"
        return embedding_prompts(self.input, self)  # type: ignore[arg-type]


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: an embeddings request, for the server's one pooling task."""

    # vLLM's: the pooling task, by default the server's (embed; no other is served).
    task: str | None = None


class _ScoringRequest(RequestBody):
    """What vLLM's /score and /rerank share."""

    model: str | None = None
    # vLLM's, as on completions: the base of the answer's id.
    request_id: RequestId | None = None
    add_special_tokens: StrictBool = True
    # vLLM's: each query, and each document, cut to this many of its own tokens (before the special ones);
    # 0 keeps it whole.
    max_tokens_per_query: Annotated[StrictInt, Field(ge=0)] = 0
    max_tokens_per_doc: Annotated[StrictInt, Field(ge=0)] = 0
    # vLLM's, as on completions: each text cut on its own.
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Side | None = None
    # vLLM's: whether the embeddings are normalized, which their cosine does not see.
    use_activation: StrictBool | None = None
    priority: StrictInt | str | None = None
    timeout: Annotated[FiniteFloat, Field(gt=0)] | None = None


class ScoreRequest(_ScoringRequest):
    """vLLM's /score: a first text against each of the second side's (one text), or pair by pair (as many
    texts each); the sides in one pair of fields (kvfleet.contract.scoring)."""

    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """Each side's field and its texts."""
        self.refuse_unsupported()
        given = [name for name in type(self).model_fields if getattr(self, name) is not None]
        sides = []
        for name in score_sides(given):
            value = getattr(self, name)
            texts = [value] if isinstance(value, str) else value
            if not texts:
                raise BadRequestError(f"{name} must not be empty", param=name)
            sides.append((name, texts))
        first, second = sides
        return first, second

    def paired_sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """Each side's field and its texts, as given, checked to pair as vLLM pairs them (score_pairs)."""
        (first_name, first), (second_name, second) = self.sides()
        try:
            score_pairs(first, second)
        except ValueError:
            raise BadRequestError(
                f"{first_name} has {len(first)} texts and {second_name} {len(second)}: give one "
                f"{first_name}, or as many as {second_name}",
                param=first_name,
            ) from None
        return (first_name, first), (second_name, second)


class RerankRequest(_ScoringRequest):
    """vLLM's (and Jina's and Cohere's) /rerank: the documents ordered by relevance to the query."""

    query: str
    documents: str | list[str]
    # 0: every document.
    top_n: Annotated[StrictInt, Field(ge=0)] = 0

    def texts(self) -> list[str]:
        """The documents, a list even where one is given alone."""
        self.refuse_unsupported()
        documents = [self.documents] if isinstance(self.documents, str) else self.documents
        if not documents:
            raise BadRequestError("documents must not be empty", param="documents")
        return documents


def embedding_prompts(
    texts: str | list[str] | list[int] | list[list[int]],
    body: EmbeddingRequest | ScoreRequest | RerankRequest,
) -> CompletionRequest:
    """The completion request whose prompts (the texts) run for their hidden states: one token each."""
    return CompletionRequest(prompt=texts, add_special_tokens=body.add_special_tokens, **_pooled_run(body))


def _pooled_run(body: EmbeddingRequest | ScoreRequest | RerankRequest) -> dict[str, Any]:
    """What a request run for its prompts' hidden states takes: one greedy token, with the body's model, the
    answer's id, prompt truncation, priority and deadline."""
    return {
        "model": body.model,
        "request_id": body.request_id,
        "max_tokens": 1,
        "temperature": 0.0,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "truncation_side": body.truncation_side,
        "priority": body.priority,
        "timeout": body.timeout,
    }


class ImageURL(Body):
    url: str
    detail: str | None = None


class InputAudio(Body):
    data: str  # base64
    format: str


_PART_TYPES = ("text", "image_url", "input_audio")


class ContentPart(Body):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None

    @model_validator(mode="after")
    def _holds_its_type(self) -> ContentPart:
        # Each known type carries a field of its own name: a part without it has nothing to render or load.
        if self.type in _PART_TYPES and getattr(self, self.type) is None:
            raise ValueError(f"a content part of type {self.type!r} needs its {self.type!r} field")
        return self

    @property
    def is_text(self) -> bool:
        return self.type == "text" and self.text is not None


class FunctionCall(Body):
    name: str
    # JSON text, as the model wrote it.
    arguments: str


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self._content(index)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    # Chat templates take the arguments as an object, as Transformers documents them.
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def _content(self, index: int) -> str | list[dict[str, str]]:
        """The text, or the parts in order ({"type": "text", "text": ...}, and {"type": "image"} and
        {"type": "audio"}, which a multimodal model's template renders as its placeholder tokens), for the
        rendering to give the template as it takes them (kvfleet.runtime.chat_content_format)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[dict[str, str]] = []
        for part_index, part in enumerate(self.content):
            if part.is_text:
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image_url" and part.image_url is not None:
                parts.append({"type": "image"})
            elif part.type == "input_audio" and part.input_audio is not None:
                parts.append({"type": "audio"})
            else:
                raise BadRequestError(
                    f"content parts are text, image_url or input_audio, got type {part.type!r}",
                    param=f"messages.{index}.content.{part_index}",
                )
        return parts


def _arguments(text: str) -> Any:
    """A call's arguments as an object, or the text itself where it is not a JSON object."""
    try:
        value = json_depth.loads(text)
    except (json.JSONDecodeError, json_depth.JSONTooDeepError):
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


def message_text(message: dict[str, Any]) -> str:
    """A template message's text, its image and audio parts left out (its text parts joined by newlines, as a
    template that takes a string gets them)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part["type"] == "text")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them."""
    if not messages:
        raise BadRequestError("messages must not be empty", param="messages")
    return [message.as_template_input(index) for index, message in enumerate(messages)]


# The content part types that carry media, and the modality of each.
_PART_MODALITIES = {"image_url": "image", "input_audio": "audio"}


def media_parts(messages: list[ChatMessage]) -> list[tuple[str, str, ContentPart]]:
    """(param, modality, part) of every image and audio part, in conversation order."""
    found = []
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                if part.type in _PART_MODALITIES:
                    found.append(
                        (f"messages.{index}.content.{part_index}", _PART_MODALITIES[part.type], part)
                    )
    return found


def check_conversation_end(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """A rendered conversation ends with a new turn opened for the answer, or within its last message: not
    both."""
    if add_generation_prompt and continue_final_message:
        raise BadRequestError(
            "continue_final_message goes on with the last message, add_generation_prompt opens a new one: "
            "set add_generation_prompt to false",
            param="continue_final_message",
        )


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    # vLLM's: the prompt ends within the last message, which the answer goes on with (a prefilled reply).
    continue_final_message: StrictBool = False
    # vLLM's: an answer in the last message's role begins with that message's text.
    echo: StrictBool = False
    tools: list[Tool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # vLLM's: variables the chat template reads beyond the messages (Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the chat template to render with instead of the server's (--trust-request-chat-template).
    chat_template: str | None = None
    # OpenAI's, as vLLM serves it: the template's reasoning_effort variable, and its enable_thinking unless
    # chat_template_kwargs sets that (off only for "none").
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's: with false, the answer leaves out what the reasoning parser reads as reasoning.
    include_reasoning: StrictBool = True

    def effort_variables(self) -> dict[str, Any]:
        """The template variables reasoning_effort sets, over any other."""
        if self.reasoning_effort is None:
            return {}
        variables: dict[str, Any] = {"reasoning_effort": self.reasoning_effort}
        if "enable_thinking" not in (self.chat_template_kwargs or {}):
            variables["enable_thinking"] = self.reasoning_effort != "none"
        return variables

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        self._check_common()
        check_conversation_end(self.add_generation_prompt, self.continue_final_message)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs, defaults)


class ModerationTextInput(Body):
    type: Literal["text"]
    text: str


class ModerationRequest(RequestBody):
    """OpenAI's moderation request: one text or several (as strings or text parts)."""

    input: str | list[str] | list[ModerationTextInput]
    model: str | None = None

    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise BadRequestError("input must not be empty", param="input")
        return [item if isinstance(item, str) else item.text for item in self.input]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # For `prompt` only: a chat template already writes the special tokens its model needs.
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the chat template to render with instead of the server's (--trust-request-chat-template).
    chat_template: str | None = None
    # vLLM's: each token's piece in the vocabulary too, as `token_strs`.
    return_token_strs: StrictBool = False

    def check(self) -> None:
        self.refuse_unsupported()
        check_conversation_end(self.add_generation_prompt, self.continue_final_message)
        if (self.prompt is None) == (self.messages is None):
            raise BadRequestError("give exactly one of prompt and messages", param="prompt")
        for name in ("chat_template_kwargs", "chat_template"):
            if self.prompt is not None and getattr(self, name):
                raise BadRequestError(f"{name} applies to messages only", param=name)
        if self.messages is not None and self.add_special_tokens:
            raise BadRequestError(
                "add_special_tokens applies to prompt only; the chat template adds the special tokens "
                "the model needs",
                param="add_special_tokens",
            )


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens` (the prompt tokens the prefix cache held) where it is reported."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


class BatchCreateRequest(Body):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class LoadLoRAAdapterRequest(Body):
    """vLLM's body for POST /v1/load_lora_adapter."""

    lora_name: Annotated[str, Strict()]
    lora_path: Annotated[str, Strict()]


class UnloadLoRAAdapterRequest(Body):
    """vLLM's body for POST /v1/unload_lora_adapter (its lora_int_id is accepted and not needed)."""

    lora_name: Annotated[str, Strict()]
    lora_int_id: StrictInt | None = None
