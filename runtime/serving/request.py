"""An admitted request, and what each generating route adds to the admission the service runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from kvfleet.contract.request_ids import usable_request_id
from kvfleet.runtime.engine.sequences import ResumedSequence
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from kvfleet.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.runtime.serving.responses import Choice, ChoiceBuilder
from kvfleet.runtime.serving.safety import RequestSafety

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService


@dataclass(frozen=True)
class RequestHeaders:
    """What a request's HTTP headers ask beside its body."""

    # An SLA tier's name or its integer (kvfleet.contract.tiers.PRIORITY_HEADER).
    priority: str | None = None
    # vLLM's X-Request-Id: the base of the answer's id, before the body's request_id.
    request_id: str | None = None

    def chosen_id(self, body_request_id: str | None) -> str | None:
        """The id the client chose for the answer: X-Request-Id's where it can be one, else the body's
        (vLLM's order)."""
        return usable_request_id(self.request_id) or body_request_id


# A request with none: from the Batch API, say.
NO_HEADERS = RequestHeaders()


@dataclass
class Prompt:
    """What a route's request asks the model to continue, one token list per prompt."""

    token_ids: list[list[int]]
    # The request field each prompt came from, named in errors.
    params: list[str]
    # Each prompt's images, audio clips or prompt embeddings (none at all: empty).
    mm_features: list[list[MultiModalFeature]] = field(default_factory=list)


class Route(Protocol):
    """What a generating route adds to the admission: how its body becomes a prompt, and the shape of its
    answers."""

    body: ChatCompletionRequest | CompletionRequest
    chunk_object: str
    id_prefix: str
    # Whether the body's request_id is the answer's id as it is, X-Request-Id aside (the Responses API's), or
    # an id the client chose follows id_prefix.
    keeps_request_id: bool
    # What the server must serve for it (kvfleet.runtime.pooler_config): generate, or embed.
    task: str
    # Whether the answer begins with reasoning (known once the prompt is made).
    opens_in_reasoning: bool
    # Whether its usage always counts the prompt tokens the prefix cache held, as OpenAI's Responses API's
    # does (other routes count them with --enable-prompt-tokens-details).
    reports_cached_tokens: bool

    @property
    def tool_constraint(self) -> StructuredOutputsParams | None: ...

    async def prompt(self, service: OpenAIService, safety: RequestSafety | None) -> Prompt: ...

    def input_text(self, service: OpenAIService, safety: RequestSafety | None) -> str | None:
        """Once the prompt has passed its checks: what the input checkers read (None: nothing is left to
        check)."""

    def response(
        self,
        request: PreparedRequest,
        choices: list[list[Choice]],
        tokenizer: Any,
        cached_tokens: int | None,
    ) -> dict[str, Any]: ...

    def preamble(self, request: PreparedRequest) -> list[dict[str, Any]]: ...

    def first_chunk_fields(self, request: PreparedRequest) -> dict[str, Any]:
        """Fields the stream's first chunk (the preamble's first) carries beside its choice."""

    def choice_builder(
        self,
        request: PreparedRequest,
        tokenizer: Any,
        prompt_logprobs: Mapping[int, list[PromptTokenLogprobs | None]],
    ) -> ChoiceBuilder:
        """What each delta is streamed as. `prompt_logprobs`: each prompt's, by prompt index, from when the
        engine sends them (with its first output, where the request asks for them)."""


@dataclass
class PreparedRequest:
    """An admitted request: what the engine runs, and the route that shapes its answer."""

    route: Route
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
    # Each prompt's images, audio clips or prompt embeddings (none at all: empty).
    mm_features: list[list[MultiModalFeature]] = field(default_factory=list)
    cache_salt: str | None = None
    # A continuation's: per prompt, what its choices already delivered, by sequence index; empty otherwise.
    resumed: list[dict[int, ResumedSequence]] = field(default_factory=list)
    # Where the client chose the answer's id, which requests in flight may share, what makes its engine
    # requests' ids their own.
    engine_suffix: str = ""
    # With use_beam_search: each prompt's search, which runs instead of its engine request.
    beam_searches: list[BeamSearchParams] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return self.route.body.stream

    @cached_property
    def engine_request_ids(self) -> list[str]:
        """One engine request per prompt."""
        base = f"{self.request_id}{self.engine_suffix}"
        return [f"{base}-{index}" for index in range(len(self.prompt_token_ids))]

    @cached_property
    def prompt_index(self) -> dict[str, int]:
        return {request_id: index for index, request_id in enumerate(self.engine_request_ids)}
