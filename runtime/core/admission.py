"""The parts the scheduler asks in turn before it admits a waiting request, each with one job.

Gates may make a request step aside and keep its place in the queue (its grammar still compiles, its adapter
would be one too many for the step, it is background while others are present), or end admission for the
step. Sources of computed tokens say how much of a request's prompt needs no computing past the device's
prefix-cache hits, and bring it in once the request has blocks: a decode call's KV on the prefill replica that
computed it (arriving later: the request waits for it), a preempted request's KV saved in the host tier, or
prefix blocks the host tier holds. What is left is cut to the step's budgets (StepBudget.grant, the
one rule of how many tokens a request takes in a step), then given KV blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvfleet.runtime.core.block_pool import KVCacheBlock
from kvfleet.runtime.core.host_kv_tier import HostKVTier
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.kv_transfer.base import KVConnectorScheduler
from kvfleet.runtime.request import Request


class Verdict(enum.Enum):
    ADMIT = enum.auto()
    # The request waits, in its place; the ones behind it may go first.
    STEP_ASIDE = enum.auto()
    # No waiting request is admitted this step.
    STOP = enum.auto()


@dataclass(frozen=True)
class Grant:
    """What a request takes of a step's budgets."""

    num_tokens: int
    encoder_cost: int = 0
    # Whether its tokens count against the background tier's share.
    background: bool = False


@dataclass
class StepBudget:
    """What a step has left to give: tokens, the encoder's input tokens, and the background tier's share
    (None without a background tier; `hold_background` when other requests are present, which also keeps
    new background requests from starting). `per_request`: the most tokens one request takes (None for no
    limit)."""

    tokens: int
    encoder: int
    background: int | None
    hold_background: bool
    per_request: int | None = None

    def grant(
        self, request: Request, num_computed: int, num_pending: int, *, background: bool, whole: bool
    ) -> Grant:
        """How many of the request's num_pending tokens after num_computed it may take this step: what the
        token budget leaves (and the background tier's share, for a background request) up to per_request,
        cut before the first image or audio clip the encoder budget cannot take. `whole`: a prompt admitted
        without chunked prefill, which runs whole or not at all (the background share cannot cut it either).
        No tokens: it waits.

        The items fed are encoded in this step, except those an earlier step began (encoded then); at
        admission, when no step has begun any, also one that a prefix-cache hit ends inside."""
        background = background and not whole
        limit = min(self.tokens, self.background or 0) if background else self.tokens
        if self.per_request is not None:
            limit = min(limit, self.per_request)
        num_tokens = max(min(num_pending, limit), 0)
        end = num_computed + num_tokens
        cost = 0
        for feature in request.mm_features:  # in prompt order
            if feature.offset >= end:
                break
            if feature.end <= num_computed or feature.offset < request.num_computed_tokens:
                continue
            if feature.embeddings_given:
                continue  # no encoder runs for it
            if cost + feature.length > self.encoder:
                num_tokens = max(feature.offset - num_computed, 0)
                break
            cost += feature.length
        if num_tokens == 0 or (whole and num_tokens < num_pending):
            return Grant(0)
        return Grant(num_tokens, cost, background)

    def take(self, grant: Grant) -> None:
        self.tokens -= grant.num_tokens
        self.encoder -= grant.encoder_cost
        if grant.background:
            assert self.background is not None
            self.background -= grant.num_tokens


class AdmissionGate(Protocol):
    def start_step(self, running: list[Request], budget: StepBudget) -> None:
        """Called once per step before the first request is checked."""
        ...

    def check(self, request: Request) -> Verdict: ...

    def admitted(self, request: Request) -> None:
        """The request was given blocks and runs from this step on."""
        ...


class BackgroundHold:
    """While other requests are present, background requests wait. In a priority queue they are last, so
    the first one ends admission; in a first-come queue the requests behind it may still go."""

    def __init__(self, is_background: Callable[[Request], bool], policy: str) -> None:
        self._is_background = is_background
        self._held = Verdict.STOP if policy == "priority" else Verdict.STEP_ASIDE
        self._holding = False

    def start_step(self, running: list[Request], budget: StepBudget) -> None:
        self._holding = budget.hold_background

    def check(self, request: Request) -> Verdict:
        return self._held if self._holding and self._is_background(request) else Verdict.ADMIT

    def admitted(self, request: Request) -> None:
        pass


def grammar_pending(request: Request) -> bool:
    """Whether the request's grammar is still compiling: it cannot be sampled yet."""
    return request.grammar is not None and not request.grammar.ready


class GrammarReady:
    """A request whose grammar is still compiling waits without holding up the others."""

    def start_step(self, running: list[Request], budget: StepBudget) -> None:
        pass

    def check(self, request: Request) -> Verdict:
        return Verdict.STEP_ASIDE if grammar_pending(request) else Verdict.ADMIT

    def admitted(self, request: Request) -> None:
        pass


class LoraSlots:
    """A step runs at most `max_loras` adapters (the model runner's slots): a request whose adapter would be
    one more waits for a step with room for it."""

    def __init__(self, max_loras: int) -> None:
        self._max_loras = max_loras
        self._in_step: set[int] = set()

    def start_step(self, running: list[Request], budget: StepBudget) -> None:
        self._in_step = {request.lora_int_id for request in running if request.lora_int_id}

    def check(self, request: Request) -> Verdict:
        lora = request.lora_int_id
        if lora and lora not in self._in_step and len(self._in_step) >= self._max_loras:
            return Verdict.STEP_ASIDE
        return Verdict.ADMIT

    def admitted(self, request: Request) -> None:
        if request.lora_int_id:
            self._in_step.add(request.lora_int_id)


@dataclass(frozen=True)
class ComputedPrefix:
    """The part of a request's prompt that needs no computing this time, and where it comes from."""

    # Hits in the device's prefix cache, which the request shares.
    device_blocks: list[KVCacheBlock]
    # Tokens computed in all: the device's hits, and the tokens a source brings in.
    num_tokens: int
    # Of those, the tokens `source` brings in: they follow the device's hits, in blocks allocated like new
    # ones.
    num_loaded: int = 0
    source: ComputedTokenSource | None = None
    # The loaded tokens arrive in the background: the request waits for them, holding its blocks.
    arrives_later: bool = False


class ComputedTokenSource(Protocol):
    def extend(self, request: Request, prefix: ComputedPrefix) -> ComputedPrefix:
        """The prefix, longer if this source holds more of the request's computed tokens."""
        ...

    def admitted(self, request: Request, prefix: ComputedPrefix, new_block_ids: list[int]) -> None:
        """The request got blocks (new_block_ids: those after the device's hits): bring in what this source
        offered, if the prefix is its own."""
        ...


def find_computed_prefix(
    request: Request, kv: KVCacheManager, sources: list[ComputedTokenSource]
) -> ComputedPrefix:
    """The longest computed prefix the device cache and the sources offer together. As with a device hit, the
    last token runs again, to give logits. A request for its prompt's logprobs, or for a pooling of all its
    hidden states, computes the whole prompt, as in vLLM."""
    if request.sampling_params.computes_whole_prompt:
        return ComputedPrefix([], 0)
    device_blocks, num_cached = kv.get_computed_blocks(request)
    prefix = ComputedPrefix(device_blocks, num_cached)
    for source in sources:
        prefix = source.extend(request, prefix)
    return prefix


class RemoteKV:
    """A decode call's prompt KV, computed by a prefill replica: the KV connector pulls the blocks past the
    device's hits into the request's fresh blocks while the request waits (the prompt's last token runs here
    again, to give logits)."""

    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager) -> None:
        self._connector = connector
        self._kv = kv

    def extend(self, request: Request, prefix: ComputedPrefix) -> ComputedPrefix:
        num_external, arrives_later = self._connector.get_num_new_matched_tokens(request, prefix.num_tokens)
        if not num_external:
            return prefix
        return ComputedPrefix(
            prefix.device_blocks,
            prefix.num_tokens + num_external,
            num_external,
            source=self,
            arrives_later=arrives_later,
        )

    def admitted(self, request: Request, prefix: ComputedPrefix, new_block_ids: list[int]) -> None:
        if prefix.source is self:
            block_ids = self._kv.get_block_ids(request.request_id)
            self._connector.update_state_after_alloc(request, block_ids, prefix.num_loaded)


class SavedKV:
    """A preempted request's own KV, saved in the host tier: it beats a shorter prefix, and is copied back
    into fresh blocks. A preempted request resuming otherwise is counted as recomputed, and its save
    dropped."""

    def __init__(self, tier: HostKVTier, block_size: int) -> None:
        self._tier = tier
        self._block_size = block_size

    def extend(self, request: Request, prefix: ComputedPrefix) -> ComputedPrefix:
        num_saved = min(self._tier.saved_tokens(request.request_id), request.num_tokens - 1)
        if num_saved <= prefix.num_tokens:
            return prefix
        return ComputedPrefix([], num_saved, num_loaded=num_saved, source=self)

    def admitted(self, request: Request, prefix: ComputedPrefix, new_block_ids: list[int]) -> None:
        if prefix.source is self:
            num_blocks = -(-self._tier.saved_tokens(request.request_id) // self._block_size)
            self._tier.restore(request.request_id, new_block_ids[:num_blocks])
        elif request.num_preemptions:
            self._tier.resume_by_recompute(request.request_id)


class HostPrefixBlocks:
    """Prefix-cache blocks the device evicted into the host tier: a prefix may go on there past the device's
    hits (never to the block of the request's last token, which must run to give logits). The blocks found
    are claimed for the step, and copied into fresh blocks."""

    def __init__(self, tier: HostKVTier, kv: KVCacheManager) -> None:
        self._tier = tier
        self._block_size = kv.block_size

    def extend(self, request: Request, prefix: ComputedPrefix) -> ComputedPrefix:
        if prefix.source is not None:
            return prefix
        first = len(prefix.device_blocks)
        hashes = request.block_hashes[first : (request.num_tokens - 1) // self._block_size]
        num_loaded = self._tier.claim_prefix(hashes) * self._block_size
        if not num_loaded:
            return prefix
        return ComputedPrefix(prefix.device_blocks, prefix.num_tokens + num_loaded, num_loaded, source=self)

    def admitted(self, request: Request, prefix: ComputedPrefix, new_block_ids: list[int]) -> None:
        if prefix.source is self:
            first = len(prefix.device_blocks)
            num_blocks = prefix.num_loaded // self._block_size
            self._tier.load_prefix(
                request.block_hashes[first : first + num_blocks], new_block_ids[:num_blocks]
            )


def admission_gates(
    *, policy: str, max_loras: int | None, is_background: Callable[[Request], bool] | None
) -> list[AdmissionGate]:
    """The gates of a scheduler's features: background hold with a background tier (`is_background`), the
    grammar, LoRA slots with LoRA."""
    gates: list[AdmissionGate] = []
    if is_background is not None:
        gates.append(BackgroundHold(is_background, policy))
    gates.append(GrammarReady())
    if max_loras is not None:
        gates.append(LoraSlots(max_loras))
    return gates


def computed_token_sources(
    host_tier: HostKVTier | None, kv: KVCacheManager, connector: KVConnectorScheduler | None
) -> list[ComputedTokenSource]:
    """Where computed tokens come from besides the device's prefix cache: the KV connector, if there is one
    (first: a decode call's prompt is all there), and the host tier, if there is one (its prefix blocks only
    with prefix caching)."""
    sources: list[ComputedTokenSource] = []
    if connector is not None:
        sources.append(RemoteKV(connector, kv))
    if host_tier is None:
        return sources
    sources.append(SavedKV(host_tier, kv.block_size))
    if kv.enable_caching:
        sources.append(HostPrefixBlocks(host_tier, kv))
    return sources
