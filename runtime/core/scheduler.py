"""Continuous batching with vLLM v1 semantics.

There are no prefill and decode phases: every request simply has num_computed_tokens catching up with
num_tokens, and each step gives the token budget first to running requests (in admission order), then
to waiting ones while budget, sequence slots and KV blocks last. When a running request cannot get a
block, the scheduler preempts by recompute: the victim drops its blocks (cached ones stay findable),
goes back to the front of the waiting queue and, when readmitted, reuses its cached prefix.

Speculative decoding: a running request's draft tokens (request.spec_token_ids) are scheduled after its own
like prompt tokens, taking budget and KV slots; the ones the model rejects give their slots back.

Admission asks small parts in turn (admission.py): gates that may set a waiting request aside (grammar not
compiled, no LoRA slot, background held), then the sources of its computed prefix (the device's prefix
cache, the host tier), then the step's budgets, then the KV blocks. Each is built once, for the features
the scheduler is given.

Disaggregated prefill and decode (a KV connector): a decode call's prompt KV is one more source of computed
tokens, pulled in the background while the request waits in WAITING_FOR_REMOTE_KVS, holding its blocks and a
sequence slot but no step budget; a failed pull sends it back to the front of the queue to compute its prompt
itself (or, under the policy "fail", finishes it with an error). A prefill call's blocks outlive it, held
for the pull until the connector lets them go.

Multimodal prompts: the items (images, audio clips) whose placeholder tokens a step starts feeding are encoded
in that step, and their placeholders count against the step's encoder budget (vLLM's
max_num_encoder_input_tokens). A request whose next item does not fit is cut before it and goes on in a later
step; decodes never wait for items.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.engine import preempts
from kvfleet.contract.precedence import displaces, is_background
from kvfleet.runtime.core.admission import (
    ComputedPrefix,
    StepBudget,
    Verdict,
    admission_gates,
    computed_token_sources,
    find_computed_prefix,
    grammar_pending,
)
from kvfleet.runtime.core.host_kv_tier import HostKVTier
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvfleet.runtime.core.request_queue import create_request_queue
from kvfleet.runtime.errors import InvalidContinuationError
from kvfleet.runtime.input_checks import check_context_length
from kvfleet.runtime.kv_events.collector import KVEventSink
from kvfleet.runtime.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler
from kvfleet.runtime.request import FinishReason, PromptTokenLogprobs, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
# Tokens a step gives background requests: alone, enough for full-speed prefill chunks and a wide batch of
# decodes, while a step stays short enough that a request of another tier arriving does not wait long for
# it; beside other requests, a few decodes, so that a step stays about as short as theirs would be (on a
# CPU a step's time grows with every token in it).
_BACKGROUND_TOKENS_ALONE = 256
_BACKGROUND_TOKENS_BESIDE_FOREGROUND = 8


@dataclass
class _DraftCounts:
    """The drafts verified so far (speculative decoding), for the acceptance metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def count(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.num_accepted_tokens_per_pos
        if len(per_position) < num_draft_tokens:
            per_position.extend([0] * (num_draft_tokens - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_kv_blocks: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        max_loras: int | None = None,
        background_priority: int | None = None,
        sliding_window: int | None = None,
        host_kv_tier: HostKVTier | None = None,
        max_num_encoder_input_tokens: int | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        kv_events: KVEventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`sliding_window`: the model's, when every layer has one (blocks before it are freed as requests
        grow). `host_kv_tier`: where preempted requests' KV waits for them instead of being recomputed, and
        where evicted prefix blocks go. `max_num_encoder_input_tokens`: the encoder budget of a step; by
        default the token budget. `kv_connector`: disaggregated prefill and decode's (its scheduler side)."""
        _check_limits(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        self.waiting = create_request_queue(policy)
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens or max_num_batched_tokens
        # Requests of this priority or less urgent (the batch tier), under either policy, only take the
        # capacity the others leave (see _step_budget); while others are present, none of them is admitted.
        self.background_priority = background_priority
        self.clock = clock
        self.host_kv_tier = host_kv_tier
        self.kv_cache_manager = self._kv_cache_manager(
            num_kv_blocks, block_size, enable_prefix_caching, sliding_window, kv_events
        )
        # What may hold a waiting request back, and where its computed tokens may come from (admission.py).
        self._admission_gates = admission_gates(
            policy=policy,
            max_loras=max_loras,
            is_background=None if background_priority is None else self._is_background,
        )
        self.kv_connector = kv_connector
        self._computed_token_sources = computed_token_sources(
            host_kv_tier, self.kv_cache_manager, kv_connector
        )
        # Requests whose prompt KV is arriving; finished ones whose blocks the connector still needs (held for
        # a pull, or written by a load that is stopping); loads failed under the policy fail (id, reason).
        self._waiting_for_kvs: dict[str, Request] = {}
        self._freed_later: dict[str, Request] = {}
        self.failed_kv_loads: list[tuple[str, str]] = []
        # Every unfinished request, by id, and how many of them are not background.
        self.requests: dict[str, Request] = {}
        self._num_foreground = 0
        # Admission order. Finished requests are dropped lazily (see _drop_finished_running).
        self.running: list[Request] = []
        self._running_has_finished = False
        self._finished_request_ids: set[str] = set()
        # Requests schedule() timed out, reported by the next update_from_output().
        self._timed_out_outputs: list[EngineCoreOutput] = []
        # (deadline, sequence, request); entries of requests that finished otherwise are skipped when popped.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_sequence = itertools.count()
        self.num_preempted_total = 0
        self.num_prefill_tokens_computed = 0
        self._drafts = _DraftCounts()

    def _kv_cache_manager(
        self,
        num_kv_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None,
        kv_events: KVEventSink | None,
    ) -> KVCacheManager:
        """The device's blocks, which tell `kv_events` what they store and evict; with prefix caching, those
        they evict spill to the host tier, if there is one."""
        tier = self.host_kv_tier
        spill = tier.spill if tier is not None and enable_prefix_caching else None
        return KVCacheManager(
            num_kv_blocks,
            block_size,
            enable_prefix_caching,
            sliding_window=sliding_window,
            on_evict=spill,
            events=kv_events,
        )

    # Requests in and out.

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} must be new, not {request.status.name}")
        check_context_length(request.num_tokens, self.max_model_len, num_output_tokens=0)
        if request.output_token_ids:
            _check_resumed(request, self.max_model_len)
        self.requests[request.request_id] = request
        self._num_foreground += not self._is_background(request)
        self.waiting.add(request)
        if request.deadline is not None:
            if len(self._deadlines) > 2 * len(self.requests) + 64:
                self._deadlines = [entry for entry in self._deadlines if not entry[2].is_finished]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (request.deadline, next(self._deadline_sequence), request))

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string, error) in any state, freeing their blocks at
        once. Unknown or already finished ids are ignored: the request may have just finished on its own."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{RequestStatus(status).name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished_any = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                finished_any = True
        if finished_any and status == RequestStatus.FINISHED_ERROR:
            # A failed step may have left blocks registered in the prefix cache but never written.
            self.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Also true while a timed-out request's end is still to be reported by update_from_output(), so
        that a loop stepping until this is false delivers every request's end."""
        return bool(self.requests) or bool(self._timed_out_outputs)

    def has_pending_kv_transfers(self) -> bool:
        """Whether blocks are held for pulls or loads are under way: the engine keeps stepping to let them
        go."""
        return self.kv_connector is not None and self.kv_connector.has_pending()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._timed_out_outputs)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, on the device and in the host tier."""
        self.kv_cache_manager.reset_prefix_cache()
        if self.host_kv_tier is not None:
            self.host_kv_tier.reset_prefixes()
        self.kv_cache_manager.events.cleared()

    @property
    def stats(self) -> SchedulerStats:
        self._drop_finished_running()
        kv = self.kv_cache_manager
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._waiting_for_kvs),
            num_queued_prompt_tokens=self._queued_prompt_tokens(),
            num_preempted_total=self.num_preempted_total,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_prefill_tokens_computed=self.num_prefill_tokens_computed,
            spec_decode_num_drafts=self._drafts.num_drafts,
            spec_decode_num_draft_tokens=self._drafts.num_draft_tokens,
            spec_decode_num_accepted_tokens=self._drafts.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self._drafts.num_accepted_tokens_per_pos),
            **self._host_tier_stats(),
        )
        if self.kv_connector is not None:
            self.kv_connector.fill_stats(stats)
        return stats

    def _queued_prompt_tokens(self) -> int:
        """The prompt tokens still to compute: all of a waiting request's (a preempted one's outputs included,
        which it recomputes), the rest of a running one's prompt; none of those arriving from a prefill
        replica."""
        queued = 0
        for request in self.requests.values():
            if request.status == _RUNNING:
                queued += max(request.num_prompt_tokens - request.num_computed_tokens, 0)
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                queued += request.num_tokens - request.num_computed_tokens
        return queued

    def _host_tier_stats(self) -> dict[str, int]:
        tier = self.host_kv_tier
        if tier is None:
            return {}
        return {
            "kv_offload_blocks_offloaded": tier.blocks_offloaded,
            "kv_offload_blocks_reloaded": tier.blocks_reloaded,
            "kv_offload_resumed_from_host": tier.resumed_from_host,
            "kv_offload_resumed_by_recompute": tier.resumed_by_recompute,
            "kv_offload_prefix_blocks_spilled": tier.prefix_blocks_spilled,
            "kv_offload_prefix_blocks_loaded": tier.prefix_blocks_loaded,
        }

    # One step.

    def schedule(self) -> SchedulerOutput:
        if self._deadlines:
            self._expire_deadlines()
        self._drop_finished_running()
        budget = self._step_budget()
        # Decided before anything is allocated this step, so the victims have no blocks in flight.
        displaced = self._make_room_for_higher_priority()
        # Insertion ordered: the batch order. A request preempted after being scheduled is popped out.
        scheduled: dict[Request, int] = {}
        preempted = self._schedule_running(scheduled, budget)
        if preempted:
            self.running = [request for request in self.running if request.status == _RUNNING]
        self._cache_scheduled_blocks(scheduled)
        # Admitting new work in a step that had to preempt would only thrash.
        if not preempted:
            self._admit_waiting(scheduled, budget, displaced)
        output = self._build_output(scheduled, budget.tokens, displaced + preempted)
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta()
        return output

    def connector_step(self) -> SchedulerOutput:
        """A step that runs no request, only the KV connector's orders given since schedule() (the offers of
        the prefill calls that step finished)."""
        assert self.kv_connector is not None
        return SchedulerOutput(
            [], [], [], [], 0, kv_connector_metadata=self.kv_connector.build_connector_meta()
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply the sampled tokens of the step, finish requests that stop, and return what changed."""
        if runner_output.kv_connector_output is not None:
            self._update_from_kv_xfer_finished(runner_output.kv_connector_output)
        outputs = self._timed_out_outputs
        self._timed_out_outputs = []
        requests = scheduler_output.requests
        sampled_token_ids = runner_output.sampled_token_ids
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        if len(sampled_token_ids) != len(requests) or len(runner_output.req_ids) != len(requests):
            raise ValueError(
                f"the model runner returned {len(sampled_token_ids)} results for {len(requests)} requests"
            )
        all_logprobs = runner_output.logprobs
        req_ids = runner_output.req_ids
        max_model_len = self.max_model_len
        self._fill_in_prompt_logprobs(runner_output)
        for index, request in enumerate(requests):
            new_token_ids = sampled_token_ids[index]
            # Requests finished from outside after schedule() lose their last tokens.
            if not new_token_ids or request.status != _RUNNING:
                continue
            request_id = request.request_id
            if req_ids[index] != request_id:
                raise ValueError(f"model runner result {index} is for {req_ids[index]!r}, not {request_id!r}")
            draft_token_ids = spec_decode_tokens.get(request_id, ())
            if request.num_computed_tokens != len(request.all_token_ids) + len(draft_token_ids):
                raise ValueError(f"the model runner sampled for {request_id!r} before its prefill ended")
            if draft_token_ids:
                self._roll_back_rejected_drafts(request, draft_token_ids, new_token_ids)
            new_logprobs = all_logprobs[index] if all_logprobs else None
            finish_reason = None
            kv_transfer_params = None
            grammar = request.grammar
            for position, token_id in enumerate(new_token_ids):
                request.output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                if grammar is not None and not grammar.accept(token_id):
                    # Sampling masks what the grammar forbids, so only a row with nothing allowed gets here.
                    status = RequestStatus.FINISHED_ERROR
                else:
                    status = _check_stop(request, token_id, len(request.output_token_ids), max_model_len)
                if status is not None:
                    if position + 1 < len(new_token_ids):
                        new_token_ids = new_token_ids[: position + 1]
                        if new_logprobs is not None:
                            new_logprobs = new_logprobs[: position + 1]
                    kv_transfer_params = self._finish(request, status)
                    finish_reason = request.finish_reason
                    break
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    new_token_ids,
                    new_logprobs,
                    finish_reason,
                    request.stop_reason,
                    max(request.num_cached_tokens, 0),
                    kv_transfer_params if finish_reason is not None else None,
                    runner_output.prompt_hidden_states.get(request_id),
                    None if request.prompt_logprobs is None else self._take_prompt_logprobs(request),
                )
            )
        self._drop_finished_running()
        return outputs

    # Internals.

    def _fill_in_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        """The prompt logprobs the step scored, each at its position (a recomputed chunk writes the same)."""
        for request_id, (first_position, entries) in runner_output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs[first_position : first_position + len(entries)] = entries

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> list[PromptTokenLogprobs | None] | None:
        """The prompt's logprobs, once: with its first output token (a recomputed prompt scores no more)."""
        prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        return prompt_logprobs

    def _update_from_kv_xfer_finished(self, output: KVConnectorOutput) -> None:
        """Free the blocks the connector let go; start the requests whose KV arrived; send those whose load
        failed back to compute their prompt (or finish them, under the policy fail)."""
        assert self.kv_connector is not None
        for request_id in self.kv_connector.update_connector_output(output):
            held = self._freed_later.pop(request_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)
        for request_id in output.finished_recving:
            request = self._waiting_for_kvs.pop(request_id, None)
            if request is None:
                continue
            request.kv_transfer = None
            # As after a prefix-cache hit, the prompt's last token runs again to give logits.
            request.num_computed_tokens = request.num_prompt_tokens - 1
            request.transition(_RUNNING)
            self.running.append(request)
        for request_id, reason in output.failed_recving.items():
            request = self._waiting_for_kvs.get(request_id)
            if request is None:
                continue
            if self.kv_connector.load_failure_policy == "fail":
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self.failed_kv_loads.append((request_id, reason))
                continue
            del self._waiting_for_kvs[request_id]
            self.kv_cache_manager.free(request)
            request.kv_transfer = None
            request.num_computed_tokens = 0
            request.transition(RequestStatus.WAITING)
            self.waiting.prepend(request)

    def _roll_back_rejected_drafts(
        self, request: Request, draft_token_ids: list[int], new_token_ids: list[int]
    ) -> None:
        """new_token_ids: the accepted draft tokens and one token of the target's own. The rejected drafts'
        KV slots hold keys of tokens the request never had: they count as not computed, and blocks that only
        they used go back to the pool (caching never registered them: it stops at the request's tokens)."""
        num_accepted = len(new_token_ids) - 1
        if (
            not 0 <= num_accepted <= len(draft_token_ids)
            or new_token_ids[:num_accepted] != draft_token_ids[:num_accepted]
        ):
            raise ValueError(f"the model runner's tokens for {request.request_id!r} do not extend its drafts")
        request.num_computed_tokens -= len(draft_token_ids) - num_accepted
        self.kv_cache_manager.free_blocks_past(request, request.num_computed_tokens)
        self._drafts.count(len(draft_token_ids), num_accepted)

    def _is_background(self, request: Request) -> bool:
        return is_background(request.priority, self.background_priority)

    def _step_budget(self) -> StepBudget:
        """A step's budgets. Background requests may take _BACKGROUND_TOKENS_ALONE tokens when nothing else is
        present, _BACKGROUND_TOKENS_BESIDE_FOREGROUND (and come last) while other requests are. A request
        takes at most long_prefill_token_threshold tokens while another runs or waits: alone, it starves no
        one."""
        background, hold = None, False
        if self.background_priority is not None:
            hold = self._num_foreground > 0
            background = _BACKGROUND_TOKENS_BESIDE_FOREGROUND if hold else _BACKGROUND_TOKENS_ALONE
        per_request = None
        if self.long_prefill_token_threshold and len(self.running) + len(self.waiting) > 1:
            per_request = self.long_prefill_token_threshold
        return StepBudget(
            self.max_num_batched_tokens, self.max_num_encoder_input_tokens, background, hold, per_request
        )

    def _schedule_running(self, scheduled: dict[Request, int], budget: StepBudget) -> list[Request]:
        """Give running requests their tokens, in admission order (background last while held), preempting
        when blocks run out; returns the preempted."""
        kv = self.kv_cache_manager
        preempted: list[Request] = []
        running = sorted(self.running, key=self._is_background) if budget.hold_background else self.running
        for request in running:
            if budget.tokens <= 0:
                break
            if request.status != _RUNNING:  # preempted earlier in this loop
                continue
            # Draft tokens are budgeted like prompt tokens; those past the budget are simply not verified.
            num_pending = (
                len(request.all_token_ids) + len(request.spec_token_ids) - request.num_computed_tokens
            )
            grant = budget.grant(
                request,
                request.num_computed_tokens,
                num_pending,
                background=self._is_background(request),
                whole=False,
            )
            num_new_tokens = grant.num_tokens
            # Its previous step's output has not been applied yet, no share is left, or its next item waits.
            if not num_new_tokens:
                continue
            # Caching waits until every preemption of this step is decided: a victim scheduled earlier in this
            # loop never computes its new blocks, which must therefore never become findable.
            while kv.allocate_slots(request, num_new_tokens, delay_cache_blocks=True) is None:
                victim = self._choose_victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim in scheduled:
                    budget.tokens += scheduled.pop(victim)
                if victim is request:
                    break
            else:
                scheduled[request] = num_new_tokens
                budget.take(grant)
        return preempted

    def _cache_scheduled_blocks(self, scheduled: dict[Request, int]) -> None:
        """Make the blocks this step fills findable in the prefix cache."""
        kv = self.kv_cache_manager
        if not kv.enable_caching:
            return
        for request, num_new_tokens in scheduled.items():
            computed = request.num_computed_tokens
            # Only a step that completes a block has anything to register.
            if (computed + num_new_tokens) // kv.block_size > computed // kv.block_size:
                kv.cache_blocks(request, computed + num_new_tokens)

    def _admit_waiting(
        self, scheduled: dict[Request, int], budget: StepBudget, displaced: list[Request]
    ) -> None:
        """Admit waiting requests in queue order while the budgets, the sequence slots and the blocks last.
        A request a gate sets aside keeps its place for the next step."""
        waiting = self.waiting
        stepped_aside: list[Request] = []
        holding_slots = (
            self.running + list(self._waiting_for_kvs.values()) if self._waiting_for_kvs else self.running
        )
        for gate in self._admission_gates:
            gate.start_step(holding_slots, budget)
        while budget.tokens > 0 and len(self.running) + len(self._waiting_for_kvs) < self.max_num_seqs:
            request = waiting.peek()
            # A request displaced this step waits at least one step: taking it back at once (its blocks may
            # suffice after prefix hits the displacement could not foresee) would recompute it for nothing,
            # and it would be both preempted and scheduled in one output.
            if request is None or request in displaced:
                break
            verdict = next(
                (v for g in self._admission_gates if (v := g.check(request)) != Verdict.ADMIT), None
            )
            if verdict == Verdict.STEP_ASIDE:
                stepped_aside.append(waiting.pop())
                continue
            if verdict == Verdict.STOP or not self._admit(request, scheduled, budget):
                break
            for gate in self._admission_gates:
                gate.admitted(request)
        for request in reversed(stepped_aside):
            waiting.prepend(request)

    def _admit(self, request: Request, scheduled: dict[Request, int], budget: StepBudget) -> bool:
        """Start the queue's head if the step's budgets and the blocks can take it (whole, without chunked
        prefill); whether it started."""
        kv = self.kv_cache_manager
        prefix = find_computed_prefix(request, kv, self._computed_token_sources)
        if prefix.arrives_later:
            return self._admit_to_load(request, prefix)
        grant = budget.grant(
            request,
            prefix.num_tokens,
            request.num_tokens - prefix.num_tokens,
            background=self._is_background(request),
            whole=not self.enable_chunked_prefill,
        )
        if not grant.num_tokens:
            return False
        if not self._take_blocks(request, prefix, grant.num_tokens, _RUNNING, prefix.num_tokens):
            return False
        self.running.append(request)
        scheduled[request] = grant.num_tokens
        budget.take(grant)
        return True

    def _admit_to_load(self, request: Request, prefix: ComputedPrefix) -> bool:
        """Give the queue's head blocks for its whole prompt and have its KV loaded into them; it waits for
        its KV without taking any of the step's budget. The loaded blocks join the prefix cache only once the
        request runs: until then they hold nothing."""
        num_to_compute = request.num_tokens - prefix.num_tokens
        num_computed = prefix.num_tokens - prefix.num_loaded  # the device's hits, for now
        if not self._take_blocks(request, prefix, num_to_compute, _WAITING_FOR_REMOTE_KVS, num_computed):
            return False
        self._waiting_for_kvs[request.request_id] = request
        return True

    def _take_blocks(
        self,
        request: Request,
        prefix: ComputedPrefix,
        num_to_compute: int,
        status: RequestStatus,
        num_computed: int,
    ) -> bool:
        """Give the queue's head blocks for the tokens its prefix brings in and the num_to_compute after them,
        have the prefix's source bring them in, and move it out of the queue into `status` with num_computed
        tokens computed; False, with nothing changed, when the blocks are short."""
        kv = self.kv_cache_manager
        # Blocks a load fills are not findable until it is done: until then they hold nothing.
        delay = status == _WAITING_FOR_REMOTE_KVS
        num_new_tokens = prefix.num_loaded + num_to_compute
        if kv.allocate_slots(request, num_new_tokens, prefix.device_blocks, delay_cache_blocks=delay) is None:
            return False
        new_block_ids = kv.get_block_ids(request.request_id)[len(prefix.device_blocks) :]
        for source in self._computed_token_sources:
            source.admitted(request, prefix, new_block_ids)
        self.waiting.pop()
        request.transition(status)
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        return True

    def _build_output(
        self, scheduled: dict[Request, int], budget: int, preempted: list[Request]
    ) -> SchedulerOutput:
        block_ids = self.kv_cache_manager.req_to_block_ids
        num_computed_tokens = []
        block_tables = []
        num_prefill_tokens = 0
        spec_decode_tokens: dict[str, list[int]] = {}
        for request, num_new_tokens in scheduled.items():
            computed = request.num_computed_tokens
            num_computed_tokens.append(computed)
            block_tables.append(block_ids[request.request_id])
            computed_after = computed + num_new_tokens
            num_drafts = max(computed_after - len(request.all_token_ids), 0)
            if num_drafts:
                spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            # Each step verifies the drafts proposed for it, or none.
            request.spec_token_ids = []
            # The newest sampled token, fed once its prompt is done, is decode work, not prefill; so are
            # drafts.
            is_decode = computed_after - num_drafts == len(request.all_token_ids) and request.output_token_ids
            num_prefill_tokens += num_new_tokens - num_drafts - 1 if is_decode else num_new_tokens
            request.num_computed_tokens = computed_after
        self.num_prefill_tokens_computed += num_prefill_tokens
        output = SchedulerOutput(
            requests=list(scheduled),
            num_scheduled_tokens=list(scheduled.values()),
            num_computed_tokens=num_computed_tokens,
            block_ids=block_tables,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_request_ids=self._finished_request_ids,
            preempted_request_ids={request.request_id for request in preempted},
            scheduled_spec_decode_tokens=spec_decode_tokens,
        )
        if self.host_kv_tier is not None:
            output.tier_copies = self.host_kv_tier.take_copies()
        self._finished_request_ids = set()
        return output

    def _make_room_for_higher_priority(self) -> list[Request]:
        """Under the priority policy, a waiting request that outranks running ones takes their place when
        the sequence slots or the free blocks would otherwise keep it waiting (the worst-ranked, newest
        request goes first). Equal priorities never displace each other, so this cannot thrash."""
        if not preempts(self.policy):
            return []
        kv = self.kv_cache_manager
        displaced: list[Request] = []
        while self.running:
            head = self.waiting.peek()
            # Displacing anyone for a request whose grammar is still compiling would only thrash.
            if head is None or grammar_pending(head):
                break
            slots_full = len(self.running) + len(self._waiting_for_kvs) >= self.max_num_seqs
            # Conservative: prefix-cache hits on blocks other requests hold are not counted.
            blocks_short = kv.num_free_blocks * kv.block_size < head.num_tokens
            if not (slots_full or blocks_short):
                break
            victim = self._choose_victim()
            if not displaces(head.priority, victim.priority):
                break
            self._preempt(victim)
            self.running.remove(victim)
            displaced.append(victim)
        return displaced

    def _choose_victim(self) -> Request:
        """fcfs: the newest arrival among running requests; priority: the worst priority (largest value),
        newest arrival among equals. Ties go to the latest admitted."""
        by_priority = self.policy == "priority"
        victim: Request | None = None
        victim_key: tuple[float, float] = (0, 0.0)
        for request in self.running:
            if request.status != _RUNNING:
                continue
            key = (request.priority if by_priority else 0, request.arrival_time)
            if victim is None or key >= victim_key:
                victim, victim_key = request, key
        assert victim is not None, "a request that needs blocks is itself running"
        return victim

    def _preempt(self, request: Request) -> None:
        kv = self.kv_cache_manager
        num_computed = request.num_computed_tokens
        # KV that a sliding window already gave back in part cannot be saved whole: it is recomputed.
        if (
            self.host_kv_tier is not None
            and num_computed
            and not kv.num_released_blocks.get(request.request_id)
        ):
            block_ids = kv.get_block_ids(request.request_id)[: -(-num_computed // kv.block_size)]
            self.host_kv_tier.save(request.request_id, block_ids, num_computed)
        kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preempted_total += 1
        self.waiting.prepend(request)

    def _finish(self, request: Request, status: RequestStatus) -> dict[str, Any] | None:
        """Finish the request and free its blocks, unless the KV connector still needs them; the
        kv_transfer_params its answer carries, if any."""
        previous = request.status
        request.transition(status)
        if previous == _RUNNING:
            self._running_has_finished = True
        elif previous == _WAITING_FOR_REMOTE_KVS:
            del self._waiting_for_kvs[request.request_id]
        else:
            self.waiting.remove(request)
        kv_transfer_params = self._free_blocks(request)
        if self.host_kv_tier is not None:
            self.host_kv_tier.discard(request.request_id)
        del self.requests[request.request_id]
        self._num_foreground -= not self._is_background(request)
        self._finished_request_ids.add(request.request_id)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> dict[str, Any] | None:
        kv = self.kv_cache_manager
        request_id = request.request_id
        # A prompt whose first blocks a sliding window gave back is not whole any more: it is not offered.
        whole = request_id in kv.req_to_block_ids and not kv.num_released_blocks.get(request_id)
        if self.kv_connector is not None and whole:
            delay_free, kv_transfer_params = self.kv_connector.request_finished(
                request, kv.get_block_ids(request_id)
            )
            if delay_free:
                self._freed_later[request_id] = request
                return kv_transfer_params
        kv.free(request)
        return None

    def _drop_finished_running(self) -> None:
        if self._running_has_finished:
            self.running = [request for request in self.running if not request.is_finished]
            self._running_has_finished = False

    def _expire_deadlines(self) -> None:
        now = self.clock()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            request = heapq.heappop(deadlines)[2]
            if request.is_finished:
                continue
            self._finish(request, RequestStatus.FINISHED_TIMED_OUT)
            self._timed_out_outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    new_logprobs=None,
                    finish_reason=FinishReason.TIMEOUT,
                    stop_reason=None,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )


def _check_resumed(request: Request, max_model_len: int) -> None:
    """A continuation arrives with output tokens (delivered by another replica): none of them may have
    ended the request, or there is nothing left to continue."""
    num_prompt_tokens = request.num_prompt_tokens
    for position, token_id in enumerate(request.output_token_ids, start=1):
        # The grammar is checked apart, once compiled (StructuredOutputs).
        if _check_stop(request, token_id, position, max_model_len, num_prompt_tokens + position) is not None:
            request.stop_reason = None
            raise InvalidContinuationError(
                f"the request ends at its resumed token {position} of {request.num_output_tokens} "
                f"({token_id}): a finished choice is resumed with finished true"
            )


def _check_stop(
    request: Request,
    token_id: int,
    num_output_tokens: int,
    max_model_len: int,
    num_tokens: int | None = None,
) -> RequestStatus | None:
    """The status a request ends in after emitting token_id, its num_output_tokens-th output token (of
    num_tokens in all, by default all it has), or None if it goes on."""
    params = request.sampling_params
    num_tokens = len(request.all_token_ids) if num_tokens is None else num_tokens
    if num_output_tokens >= params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_token_id_set:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.is_terminated:
        return RequestStatus.FINISHED_STOPPED
    max_tokens = params.max_tokens
    if num_tokens >= max_model_len or (max_tokens is not None and num_output_tokens >= max_tokens):
        return RequestStatus.FINISHED_LENGTH
    return None


def _check_limits(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    num_kv_blocks: int,
    enable_chunked_prefill: bool,
    long_prefill_token_threshold: int,
) -> None:
    """Raises ValueError, naming the numbers, for limits no schedule can keep."""
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
        ("block_size", block_size),
        ("num_kv_blocks", num_kv_blocks),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if max_model_len > num_kv_blocks * block_size:
        # Otherwise a long request could preempt everything else and still not fit, forever.
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the KV cache capacity of {num_kv_blocks} blocks of "
            f"{block_size} tokens ({num_kv_blocks * block_size} tokens)"
        )
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must be at "
            f"least max_model_len ({max_model_len}) so that every prompt fits in one step"
        )
    if long_prefill_token_threshold < 0 or long_prefill_token_threshold > max_model_len:
        raise ValueError(
            f"long_prefill_token_threshold ({long_prefill_token_threshold}) must be from 0 to max_model_len "
            f"({max_model_len})"
        )
    if long_prefill_token_threshold and not enable_chunked_prefill:
        raise ValueError("long_prefill_token_threshold cuts prompts into chunks: it needs chunked prefill")
