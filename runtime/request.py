"""One generation request as the scheduler sees it: its tokens, its progress and its life-cycle state."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from kvfleet.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvfleet.runtime.engine.grammar_compiler import RequestGrammar
    from kvfleet.runtime.kv_transfer.params import KVTransferRequest
    from kvfleet.runtime.lora.request import LoRARequest
    from kvfleet.runtime.multimodal.inputs import MultiModalFeature
    from kvfleet.runtime.multimodal.mrope import MRopePositions
    from kvfleet.runtime.structured_outputs.token_rules import TokenRules


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Holding its blocks while its prompt's KV arrives from the replica that computed it; takes no step.
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    # Every status from here on is final; is_finished relies on this order.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_TIMED_OUT = 7
    FINISHED_ERROR = 8

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"


# The finish reasons that are not an answer: the client left, the engine failed the request, or its deadline
# passed.
FAILED_FINISH_REASONS = frozenset({FinishReason.ABORT, FinishReason.ERROR, FinishReason.TIMEOUT})


class InvalidStateTransition(RuntimeError):
    pass


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_TIMED_OUT: FinishReason.TIMEOUT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

_UNFINISHED_TRANSITIONS = {
    (RequestStatus.WAITING, RequestStatus.RUNNING),
    (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS),
    (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING),
    # Its load failed: it computes its prompt itself.
    (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING),
    (RequestStatus.RUNNING, RequestStatus.PREEMPTED),
    (RequestStatus.PREEMPTED, RequestStatus.RUNNING),
}


class PromptTokenLogprobs(NamedTuple):
    """A prompt token's scores from the tokens before it: the log probabilities of the token and of the N
    likeliest in its place, by id, and the token's rank among all of them (1: the likeliest)."""

    logprobs: dict[int, float]
    rank: int


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
        grammar: RequestGrammar | None = None,
        token_rules: TokenRules | None = None,
        lora_request: LoRARequest | None = None,
        model_salt: bytes | None = None,
        cache_salt: str | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        mrope_positions: MRopePositions | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.deadline = deadline
        # The constraint of structured_outputs; the scheduler admits the request once it is compiled.
        self.grammar = grammar
        # allowed_token_ids, bad_words and logit_bias, applied after the raw logprobs are taken.
        self.token_rules = token_rules
        self.lora_request = lora_request
        # What the model makes this request's KV depend on besides its tokens (see chain_seed).
        self.model_salt = model_salt
        # The tenant's salt the request brings (vLLM's cache_salt): it shares prefix-cache blocks only with
        # requests of the same salt.
        self.cache_salt = cache_salt
        # The prompt's images in prompt order, each over its run of placeholder tokens.
        self.mm_features: list[MultiModalFeature] = mm_features or []
        # Its three-dimensional positions, on a model with M-RoPE; None on others.
        self.mrope_positions = mrope_positions
        # Disaggregated prefill and decode: keep its blocks for a decode replica (a prefill call), or pull its
        # prompt's KV from a prefill replica (a decode call; None once pulled or given up).
        self.kv_transfer: KVTransferRequest | None = None

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Tokens a proposer guessed to follow all_token_ids, for the next step to verify (speculative
        # decoding).
        self.spec_token_ids: list[int] = []
        # Prefix-caching hash of each full block of all_token_ids, extended as needed by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # A set, so that the per-token stop check is O(1) whatever the number of stop ids.
        self.stop_token_id_set = frozenset(sampling_params.stop_token_ids or ())
        # With prompt_logprobs: each prompt token's after the first, filled in as the prompt's chunks run
        # (again, the same, if it is recomputed), until the first output token takes them along (then None).
        self.prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (len(self.prompt_token_ids) - 1)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter this request runs with; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    def transition(self, new_status: RequestStatus) -> None:
        """Move to new_status, or raise InvalidStateTransition if the life cycle does not allow it."""
        current = self.status
        allowed = (current, new_status) in _UNFINISHED_TRANSITIONS or (
            current <= RequestStatus.PREEMPTED and new_status > RequestStatus.PREEMPTED
        )
        if not allowed:
            target = RequestStatus(new_status).name
            raise InvalidStateTransition(
                f"request {self.request_id!r} cannot go from {current.name} to {target}"
            )
        self.status = new_status
