"""What the engine hands back to callers, in vLLM's shapes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


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
    # The final hidden state of the prompt's last token, once finished, when SamplingParams asked for it.
    prompt_hidden_state: list[float] | None = None
    # A continuation's first output: what its sequences had already delivered from another replica (their
    # resumed tokens, and the text sent of them), for the front end to catch up on; never to be sent again.
    resumed: bool = False


@dataclass
class RequestMetrics:
    """Times are time.monotonic() values; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
