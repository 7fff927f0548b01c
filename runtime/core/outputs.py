"""What flows between the scheduler, the model runner and the engine in one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.core.host_kv_tier import TierCopies
from kvfleet.runtime.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput
from kvfleet.runtime.models.moe_config import MoeLayerLoad
from kvfleet.runtime.request import FinishReason, PromptTokenLogprobs, Request


@dataclass
class SchedulerOutput:
    """One step's batch. For request i the runner feeds request.all_token_ids[c : c + n] at positions
    c .. c + n - 1 (c = num_computed_tokens[i], n = num_scheduled_tokens[i]) and samples a token only when
    c + n == request.num_tokens, i.e. when the request's prompt (or recomputed prefix) is complete.
    A request in scheduled_spec_decode_tokens has its tokens continued by those draft tokens: the runner
    feeds (all_token_ids + drafts)[c : c + n] and, when c + n == request.num_tokens + len(drafts), verifies
    the drafts: one sampled row per draft token, plus one."""

    requests: list[Request]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    # Each request's whole block table after this step's allocation; read-only for the runner.
    block_ids: list[list[int]]
    total_num_scheduled_tokens: int
    # Finished since the previous step: the runner drops their state.
    finished_request_ids: set[str] = field(default_factory=set)
    # Preempted this step: the runner drops their state; they come back later as if new.
    preempted_request_ids: set[str] = field(default_factory=set)
    # Draft tokens fed after a request's own, by request id; only requests that speculate this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Blocks to copy between the device cache and the host tier before the step runs (see HostKVTier).
    # A subset of the step leaves them out: they are made once, by the whole step.
    tier_copies: TierCopies = field(default_factory=TierCopies)
    # Adapters unloaded that no request runs with any more: the runner drops them and zeroes their slots
    # before the step runs (idempotent, so every subset of the step carries them).
    removed_lora_ids: list[int] = field(default_factory=list)
    # The KV connector's orders for this step (disaggregated prefill and decode). A subset of the step leaves
    # them out: they are carried out once, by the whole step.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    def subset(self, indices: list[int]) -> SchedulerOutput:
        """The same step for some of its requests only (finished and preempted ids go along)."""
        num_scheduled = [self.num_scheduled_tokens[i] for i in indices]
        request_ids = {self.requests[i].request_id for i in indices}
        return SchedulerOutput(
            requests=[self.requests[i] for i in indices],
            num_scheduled_tokens=num_scheduled,
            num_computed_tokens=[self.num_computed_tokens[i] for i in indices],
            block_ids=[self.block_ids[i] for i in indices],
            total_num_scheduled_tokens=sum(num_scheduled),
            finished_request_ids=self.finished_request_ids,
            preempted_request_ids=self.preempted_request_ids,
            scheduled_spec_decode_tokens={
                request_id: tokens
                for request_id, tokens in self.scheduled_spec_decode_tokens.items()
                if request_id in request_ids
            },
            removed_lora_ids=self.removed_lora_ids,
        )


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per scheduled request; empty when its prefill is not complete after this step.
    sampled_token_ids: list[list[int]]
    # One dict per sampled token (top-N plus the sampled token), or None when logprobs were not asked for.
    logprobs: list[list[dict[int, float]] | None]
    # What the KV connector's worker side finished since its last report.
    kv_connector_output: KVConnectorOutput | None = None
    # By request id: the final hidden state of the prompt's last token, for requests that asked for it and
    # sampled their first token this step.
    prompt_hidden_states: dict[str, list[float]] = field(default_factory=dict)
    # By request id: the position of the first prompt token scored this step (from the tokens before it), and
    # each scored token's logprobs, for requests that asked for their prompt's.
    prompt_logprobs: dict[str, tuple[int, list[PromptTokenLogprobs]]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_cached_tokens: int
    # A finished prefill call's answer: where its blocks wait for the decode replica.
    kv_transfer_params: dict[str, Any] | None = None
    # See ModelRunnerOutput.prompt_hidden_states.
    prompt_hidden_state: list[float] | None = None
    # The logprobs of every prompt token after the first (each one set), with the request's first output
    # token.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_cache_usage: float
    # In tokens.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Prompt (and recomputed) tokens actually run through the model; prefix-cache hits are not counted.
    num_prefill_tokens_computed: int
    # Structured outputs, filled in by the engine core: grammars compiled (cache hits are not compilations)
    # and their compile time; steps that masked constrained rows and the time filling and applying the masks.
    grammars_compiled: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_mask_steps: int = 0
    grammar_mask_seconds: float = 0.0
    # Speculative decoding, cumulative: steps in which a request verified drafts, the draft tokens verified,
    # those accepted, and those accepted at each draft position (index 0: the first draft token).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # The host-memory KV tier: blocks copied there and back, the preempted requests that resumed from it or
    # had to recompute, and the prefix-cache blocks evicted from the device into it and loaded back (its
    # hits, as the prefix-cache hit and query counters are the device's).
    kv_offload_blocks_offloaded: int = 0
    kv_offload_blocks_reloaded: int = 0
    kv_offload_resumed_from_host: int = 0
    kv_offload_resumed_by_recompute: int = 0
    kv_offload_prefix_blocks_spilled: int = 0
    kv_offload_prefix_blocks_loaded: int = 0
    # Multimodal models, filled in by the engine core: items (images) encoded, and item lookups the encoder
    # cache answered instead.
    encoder_runs: int = 0
    encoder_cache_hits: int = 0
    # Disaggregated prefill and decode, cumulative: loads completed, blocks and bytes pulled and the time the
    # pulls took, loads that fell back (recompute, or an error under the policy fail) by reason, and holds
    # withdrawn unpulled after hold_timeout_s; and the blocks held now for pulls.
    kv_transfer_loads: int = 0
    kv_transfer_blocks_pulled: int = 0
    kv_transfer_bytes_pulled: int = 0
    kv_transfer_pull_seconds: float = 0.0
    kv_transfer_fallbacks: dict[str, int] = field(default_factory=dict)
    kv_transfer_holds_expired: int = 0
    kv_transfer_blocks_held: int = 0
    # KV-cache events, cumulative: events sent to subscribers, batches dropped from the publisher's full
    # queue, and batches sent again on replay requests.
    kv_events_published: int = 0
    kv_event_batches_dropped: int = 0
    kv_event_batches_replayed: int = 0
    # Prompt tokens still to compute, of the waiting and running requests (a disaggregated service's prefill
    # role scales on them).
    num_queued_prompt_tokens: int = 0
    # Mixture-of-experts models, filled in by the engine core: the load of each sparse layer's experts.
    moe_layer_load: list[MoeLayerLoad] = field(default_factory=list)
    # vLLM's sleep mode, filled in by the engine core: 0 awake; 1 the KV cache freed, the weights kept in host
    # memory; 2 the weights dropped too. Stays above 0 until the wake-up has taken everything back.
    sleep_level: int = 0
