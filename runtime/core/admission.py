"""The parts the scheduler asks in turn before it admits a waiting request, each with one job.

Gates may make a request step aside and keep its place in the queue (its grammar still compiles, its adapter
would be one too many for the step, it is background while others are present), or end admission for the
step. Sources of computed tokens say how much of a request's prompt needs no computing, and how it is
brought in: hits in the device's prefix cache, a preempted request's KV saved in the host tier, or prefix
blocks the host tier holds. What is left is cut to the step's budgets (StepBudget), then given KV blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.runtime.core.block_pool import KVCacheBlock
from kvfleet.runtime.core.host_kv_tier import HostKVTier
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.kv_cache_utils import BlockHash
from kvfleet.runtime.request import Request


class Verdict(enum.Enum):
    ADMIT = enum.auto()
    # The request waits, in its place; the ones behind it may go first.
    STEP_ASIDE = enum.auto()
    # No waiting request is admitted this step.
    STOP = enum.auto()


@dataclass
class StepBudget:
    """What a step has left to give: tokens, the encoder's input tokens, and the background tier's share
    (None without a background tier; `hold_background` when other requests are present, which also keeps
    new background requests from starting)."""

    tokens: int
    encoder: int
    background: int | None
    hold_background: bool

    def take(self, num_tokens: int, encoder_cost: int, background: bool) -> None:
        self.tokens -= num_tokens
        self.encoder -= encoder_cost
        if background:
            assert self.background is not None
            self.background -= num_tokens


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


@dataclass
class ComputedPrefix:
    """The part of a request's prompt that needs no computing this time, and where it comes from."""

    # Hits in the device's prefix cache, which the request shares.
    device_blocks: list[KVCacheBlock]
    # Tokens computed in all: the device's hits, and the tokens copied in from the host tier.
    num_tokens: int
    # Of those, the tokens copied in from the host tier; their blocks are allocated like new ones.
    num_reloaded: int = 0
    # Whether they are a preempted request's own saved KV (else the host tier's prefix blocks, if any).
    resume_saved: bool = False
    host_prefix: list[BlockHash] = field(default_factory=list)


def find_computed_prefix(
    request: Request, kv: KVCacheManager, host_tier: HostKVTier | None
) -> ComputedPrefix:
    """The longest computed prefix the device cache and the host tier offer together. A preempted request's
    KV saved in the host tier beats a shorter prefix-cache hit; as with a hit, the last token runs again,
    to give logits."""
    device_blocks, num_cached = kv.get_computed_blocks(request)
    if host_tier is None:
        return ComputedPrefix(device_blocks, num_cached)
    num_saved = min(host_tier.saved_tokens(request.request_id), request.num_tokens - 1)
    if num_saved > num_cached:
        return ComputedPrefix([], num_saved, num_reloaded=num_saved, resume_saved=True)
    # The prefix may go on in the host tier, past the device's hits.
    host_prefix = _host_prefix(request, len(device_blocks), kv, host_tier)
    num_reloaded = len(host_prefix) * kv.block_size
    return ComputedPrefix(device_blocks, num_cached + num_reloaded, num_reloaded, host_prefix=host_prefix)


def _host_prefix(
    request: Request, num_device_hits: int, kv: KVCacheManager, host_tier: HostKVTier
) -> list[BlockHash]:
    """The hashes of the blocks the host tier holds right after the device's prefix hits (never the block of
    the request's last token, which must run to give logits), claimed for this step."""
    if not kv.enable_caching:
        return []
    hashes = request.block_hashes[num_device_hits : (request.num_tokens - 1) // kv.block_size]
    return hashes[: host_tier.claim_prefix(hashes)]
