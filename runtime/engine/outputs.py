"""What the engine hands back to callers, in vLLM's shapes."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.request import PromptTokenLogprobs


class OutputKind(enum.Enum):
    """How much of a request's progress each step reports."""

    FINAL_ONLY = "final"  # one output, when the request finishes (offline generation)
    DELTA = "delta"  # every step: only what is new since the previous output (streaming)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # A finished prefill call's answer (disaggregated prefill and decode): where its KV blocks wait, for the
    # decode call's SamplingParams.extra_args["kv_transfer_params"].
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt's final hidden states pooled as SamplingParams.prompt_pooling asked, once finished.
    prompt_hidden_state: list[float] | None = None
    # With SamplingParams.prompt_logprobs, in one output: the first after the prompt is scored (the final one
    # when only that is made). One entry per prompt token (None for the first, which nothing before it
    # scores).
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    # A continuation's first output: what its sequences had already delivered from another replica (their
    # resumed tokens, and the text sent of them), for the front end to catch up on; never to be sent again.
    resumed: bool = False

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """Two delta outputs of one request as one: each choice's text, tokens and logprobs joined, and the
        rest as the later one has it."""
        joined = {completion.index: completion for completion in self.outputs}
        for completion in later.outputs:
            earlier = joined.get(completion.index)
            if earlier is None:
                joined[completion.index] = completion
                continue
            logprobs = None
            if earlier.logprobs is not None and completion.logprobs is not None:
                logprobs = earlier.logprobs + completion.logprobs
            joined[completion.index] = dataclasses.replace(
                completion,
                text=earlier.text + completion.text,
                token_ids=earlier.token_ids + completion.token_ids,
                logprobs=logprobs,
            )
        return dataclasses.replace(later, outputs=[joined[index] for index in sorted(joined)])


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's answer to LLM.embed() for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    finished: bool
    outputs: EmbeddingOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's answer to LLM.score() for one pair: the cosine similarity of the two embeddings."""

    request_id: str
    # The two texts' tokens, one after the other.
    prompt_token_ids: list[int]
    finished: bool
    outputs: ScoringOutput


@dataclass
class RequestMetrics:
    """Times are time.monotonic() values; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
