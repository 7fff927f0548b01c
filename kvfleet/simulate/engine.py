"""A model of one replica's engine: continuous batching over a step-time model.

A step's time is linear in what it computes: a fixed cost, a cost per prompt token computed, a cost per
sequence decoding one token, and a cost per token of context the batch's sequences attend over (EngineProfile;
`kvfleet simulate calibrate` fits it to a real replica), and a step after an idle gap takes longer, as the
replica wakes. Each step is scheduled as the runtime's scheduler does: the running sequences first (one token
each while decoding, a chunk of the prompt while prefilling), then waiting requests in arrival order while
there are fewer than max_num_seqs running, tokens left in the step's budget and room in the KV cache for the
whole prompt. A sequence that outgrows the KV cache preempts the most recently admitted one, which goes back
to the front of the queue and computes its prompt and what it had generated again (recomputation, as vLLM's v1
engine does).

The prefix cache is modelled per replica as a least-recently-used set of prefix groups (the trace's
`prefix_group`), each holding the tokens its requests share: a request of a cached group starts with those
computed (all but the prompt's last token at most, which is always computed to sample from).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TypeVar

import numpy

from kvfleet.contract.metrics import ITL_BUCKETS, TTFT_BUCKETS
from kvfleet.operator.autoscaler import Buckets, PodMetrics

Count = TypeVar("Count", int, numpy.ndarray)


@dataclass(frozen=True)
class EngineProfile:
    """One replica's step-time model and limits."""

    step_fixed_s: float = 0.004
    prefill_token_s: float = 0.00005
    decode_sequence_s: float = 0.0002
    context_token_s: float = 0.0
    # What a client waits for its first token beyond the engine's steps: the request's way in through the HTTP
    # server (and a gateway, when calibrated through one) and the token's way out.
    first_token_overhead_s: float = 0.0
    # And this much more for each other sequence the replica runs then: its server streams their tokens while
    # it takes the request in (on CPUs the engine's threads also take the cores that server would use).
    first_token_overhead_per_sequence_s: float = 0.0
    # A step after an idle gap of g seconds takes wake_s * (1 - exp(-g / wake_after_s)) longer: a replica
    # left idle has its caches refilled and its threads and clocks woken by the next request.
    wake_s: float = 0.0
    wake_after_s: float = 1.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int = 262144

    def step_seconds(self, prefill_tokens: int, decode_sequences: int, context_tokens: int) -> float:
        return (
            self.step_fixed_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_sequence_s * decode_sequences
            + self.context_token_s * context_tokens
        )

    def first_token_overhead(self, beside: Count) -> Count:
        """What a first token waits beyond the steps, with `beside` other sequences running (a count, or an
        array of them)."""
        return self.first_token_overhead_s + self.first_token_overhead_per_sequence_s * beside

    def wake_seconds(self, idle_s: float) -> float:
        """What a step takes longer after the replica was idle `idle_s` seconds (math.inf: never ran)."""
        return self.wake_s * -math.expm1(-idle_s / self.wake_after_s)

    @classmethod
    def load(cls, path: Path) -> EngineProfile:
        known = {item.name for item in fields(cls)}
        values = json.loads(path.read_text())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown profile fields {unknown} (known: {sorted(known)})")
        return cls(**values)

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


@dataclass(eq=False, slots=True)
class Sequence:
    """A request inside an engine."""

    prompt_tokens: int
    output_tokens: int
    prefix_group: str
    # Tokens the requests of its prefix group share (at most the prompt).
    shared_tokens: int
    arrival_s: float
    # The tokens to compute before the next token: the prompt, plus what was generated before a preemption.
    to_compute: int = 0
    computed: int = 0
    generated: int = 0
    # Tokens decoded since the sequence was last admitted (their KV is held beside the computed prompt's).
    decoded: int = 0
    first_token_s: float | None = None
    # Whatever the fleet keeps with the sequence (the gateway's request).
    owner: object = None

    def __post_init__(self) -> None:
        self.to_compute = self.prompt_tokens

    @property
    def kv_tokens(self) -> int:
        return self.to_compute + self.decoded


@dataclass
class StepOutcome:
    """What a step produced: the sequences that got their first token, and those that finished."""

    first_tokens: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)


class LatencyHistogram:
    """One interval's latencies as a replica's histogram holds them: their sum, count and buckets."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.total = 0.0
        self.count = 0
        # Observations per bucket (not cumulative), the last past every bound.
        self.counts = [0] * (len(bounds) + 1)

    def observe(self, seconds: float, times: int = 1) -> None:
        self.total += seconds * times
        self.count += times
        self.counts[bisect.bisect_left(self.bounds, seconds)] += times

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def buckets(self) -> Buckets:
        return tuple(zip((*self.bounds, math.inf), itertools.accumulate(self.counts), strict=True))


class EngineModel:
    """One replica's engine: a queue, a running batch, a prefix cache, and the step in progress."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Prefix group -> its shared tokens, least recently used first.
        self.prefix_cache: OrderedDict[str, int] = OrderedDict()
        self._cached_tokens = 0
        # The KV tokens the running sequences hold (their kv_tokens), kept as they change rather than summed.
        self._kv_tokens = 0
        # The step in progress: (sequence, tokens it computes), and when the step started.
        self._step: list[tuple[Sequence, int]] = []
        self._step_started = 0.0
        # How many steps the step in progress is (more than one: a run of decode steps), and the first's
        # length and how much longer each next one is.
        self._steps = 1
        self._run_shape = (0.0, 0.0)
        # When the engine last went idle (None: busy); a new one has never run, and its first step wakes it.
        self._idle_since: float | None = -math.inf
        self.preemptions = 0
        self.prefix_hits = 0
        self.admitted = 0
        # Since the last report: first-token latencies, inter-token latencies.
        self._ttft = LatencyHistogram(TTFT_BUCKETS)
        self._itl = LatencyHistogram(ITL_BUCKETS)
        # Since the last report (None before the first, as a scraper has no rate before its second scrape):
        # prompt tokens of sequences whose prefill finished, tokens generated.
        self._reported_at: float | None = None
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @property
    def in_engine(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def start_step(self, now: float) -> float | None:
        """Schedules what runs next and returns how long it takes (None: nothing to run). That is one step,
        or, while every running sequence decodes and no waiting request could join, the run of decode steps
        until the first of them finishes: those steps differ only by their context, so they are one event."""
        self._make_room()
        budget = self.profile.max_num_batched_tokens
        step: list[tuple[Sequence, int]] = []
        prefill = decode = context = 0
        for sequence in self.running:
            if budget == 0:
                break
            to_prefill = sequence.to_compute - sequence.computed
            if to_prefill > 0:
                tokens = min(to_prefill, budget)
                prefill += tokens
            else:
                tokens = 1
                decode += 1
            step.append((sequence, tokens))
            budget -= tokens
            context += sequence.computed + sequence.decoded
        if decode == len(self.running) and decode and not self._admissible():
            return self._start_decode_run(now, step, context)
        while budget and self._admissible():
            sequence = self.waiting.popleft()
            self._admit(sequence)
            tokens = min(sequence.to_compute - sequence.computed, budget)
            step.append((sequence, tokens))
            budget -= tokens
            prefill += tokens
            context += sequence.computed
        if not step:
            if self._idle_since is None:
                self._idle_since = now
            return None
        wake = 0.0 if self._idle_since is None else self.profile.wake_seconds(now - self._idle_since)
        self._idle_since = None
        self._step, self._step_started, self._steps = step, now, 1
        self._run_shape = (self.profile.step_seconds(prefill, decode, context) + wake, 0.0)
        return self._run_shape[0]

    def interrupt(self, now: float) -> float | None:
        """A request arrived during a run of decode steps: the run ends with the step in progress, so that
        the next step can take the request in. Returns the run's new end, or None if it ends then anyway."""
        first, growth = self._run_shape
        elapsed = now - self._step_started
        steps, length = 1, first
        while length < elapsed and steps < self._steps:
            length += first + growth * steps
            steps += 1
        if steps == self._steps:
            return None
        self._steps = steps
        return self._step_started + length

    def finish_step(self, now: float) -> StepOutcome:
        """Applies the step (or run of decode steps) that ends now."""
        outcome = StepOutcome()
        length, steps = now - self._step_started, self._steps
        decoding = 0
        for sequence, tokens in self._step:
            if sequence.computed < sequence.to_compute:
                sequence.computed += tokens
                if sequence.computed < sequence.to_compute:
                    continue
                self._remember_prefix(sequence)
                if sequence.first_token_s is None:
                    sequence.first_token_s = now
                    self._ttft.observe(now - sequence.arrival_s)
                    self._prompt_tokens += sequence.prompt_tokens
                    outcome.first_tokens.append(sequence)
                sequence.generated += 1
                self._generation_tokens += 1
            else:
                sequence.decoded += steps
                sequence.generated += steps
                decoding += 1
            if sequence.generated >= sequence.output_tokens:
                outcome.finished.append(sequence)
        if decoding:
            # Every decoding sequence took a token at each of the run's steps, of the same length.
            self._generation_tokens += steps * decoding
            self._kv_tokens += steps * decoding
            self._itl.observe(length / steps, steps * decoding)
        for sequence in outcome.finished:
            self.running.remove(sequence)
            self._kv_tokens -= sequence.kv_tokens
        self._step = []
        return outcome

    def _start_decode_run(self, now: float, step: list[tuple[Sequence, int]], context: int) -> float:
        """As many decode steps as every sequence can take before the first finishes or the KV cache fills."""
        running = len(self.running)
        free = self.profile.kv_cache_tokens - self._kv_tokens
        steps = min(min(s.output_tokens - s.generated for s in self.running), max(1, free // running))
        first = self.profile.step_seconds(0, running, context)
        # Each step attends over one more token per sequence than the step before.
        growth = self.profile.context_token_s * running
        self._step, self._step_started, self._steps = step, now, steps
        self._run_shape = (first, growth)
        return steps * first + growth * steps * (steps - 1) / 2

    def _admissible(self) -> bool:
        """Whether the next waiting request can join the batch: a place, and KV for its whole prompt."""
        if not self.waiting or len(self.running) >= self.profile.max_num_seqs:
            return False
        fits = self._kv_tokens + self.waiting[0].kv_tokens <= self.profile.kv_cache_tokens
        return fits or not self.running

    def report(self, now: float) -> PodMetrics:
        """What the replica's /metrics would show the operator now; starts the next interval."""
        queued = sum(s.to_compute - s.computed for s in self.waiting) + sum(
            s.to_compute - s.computed for s in self.running
        )
        metrics = PodMetrics(
            waiting=len(self.waiting),
            running=len(self.running),
            kv_cache_usage=self._kv_tokens / self.profile.kv_cache_tokens,
            ttft_seconds=self._ttft.mean(),
            queued_prompt_tokens=queued,
            itl_seconds=self._itl.mean(),
            ttft_buckets=self._ttft.buckets(),
            itl_buckets=self._itl.buckets(),
            prompt_tokens_per_s=self._rate(self._prompt_tokens, now),
            generation_tokens_per_s=self._rate(self._generation_tokens, now),
        )
        self._reported_at = now
        self._ttft, self._itl = LatencyHistogram(TTFT_BUCKETS), LatencyHistogram(ITL_BUCKETS)
        self._prompt_tokens = self._generation_tokens = 0
        return metrics

    def _rate(self, tokens: int, now: float) -> float | None:
        if self._reported_at is None or now <= self._reported_at:
            return None
        return tokens / (now - self._reported_at)

    def _make_room(self) -> None:
        """Preempts the most recently admitted sequences while the next step's tokens would not fit."""
        capacity = self.profile.kv_cache_tokens
        # At most one token a running sequence: when even that fits, nothing is counted.
        if self._kv_tokens + len(self.running) <= capacity:
            return
        while len(self.running) > 1 and self._kv_tokens + self._decoding() > capacity:
            victim = self.running.pop()
            self._kv_tokens -= victim.kv_tokens
            victim.to_compute += victim.decoded
            victim.computed = victim.decoded = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def _decoding(self) -> int:
        return sum(1 for sequence in self.running if sequence.computed >= sequence.to_compute)

    def _admit(self, sequence: Sequence) -> None:
        self.admitted += 1
        cached = self.prefix_cache.get(sequence.prefix_group)
        if cached is not None and sequence.prefix_group:
            self.prefix_cache.move_to_end(sequence.prefix_group)
            sequence.computed = min(cached, sequence.shared_tokens, sequence.to_compute - 1)
            self.prefix_hits += 1
        self.running.append(sequence)
        self._kv_tokens += sequence.kv_tokens

    def _remember_prefix(self, sequence: Sequence) -> None:
        group = sequence.prefix_group
        if not group or sequence.shared_tokens == 0:
            return
        held = self.prefix_cache.pop(group, 0)
        tokens = max(held, sequence.shared_tokens)
        self.prefix_cache[group] = tokens
        self._cached_tokens += tokens - held
        while self._cached_tokens > self.profile.kv_cache_tokens:
            _, evicted = self.prefix_cache.popitem(last=False)
            self._cached_tokens -= evicted
