"""The cohort model's replicas: each replica's engine as a fluid, all of a fleet's engines advanced together.

A replica holds amounts rather than requests: requests waiting for a place in the batch, requests computing
their prompt, requests decoding, and the tokens each group has to compute or generate. Over one tick every
engine runs the steps of the request model's EngineProfile back to back, each step's shape the one its
state gives: every decoding request takes one token, and prompts are computed within what the token budget
leaves; a step's time is the profile's line in those. Places in the batch (max_num_seqs) go to the waiting
requests in their order as requests finish. A decoding request finishes with the share of the tokens left
that a token is of them (its output's mean length is what is left, on average), so the throughput of a
full batch is the profile's; where outputs vary the finish times are smoother than they are.

A request's time to first token is the engine's prediction when it arrives, in its place in the queue: the
requests ahead of it for a place in the batch, taken at the rate requests finish, then the prompt tokens
ahead of it and its own at the rate the steps compute them, after the rest of the step in progress.

Each engine is stepped on its own, in compiled loops over the slots (numba): a fleet's replicas are a few
hundred numbers each, and a tick is dozens of operations on them, which as array operations cost numpy's call
far more than their arithmetic.

What it leaves out of the request model: the KV cache's bound (no preemption; the profile's cache holds a
full batch of the traces' lengths many times over), the order within a tick (a tick's arrivals come
together at its start), and an idle replica's wake (the profile's wake_s: at the rates it is made for, many
requests a tick, a replica is never idle long).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy

from kvfleet.contract.metrics import ITL_BUCKETS, TTFT_BUCKETS
from kvfleet.operator.autoscaler import Buckets, PodMetrics
from kvfleet.simulate.engine import EngineProfile

# The engines' state, a row each of one array, a replica's figures at its slot.
(
    _WAITING,
    # The waiting requests' tokens: those to compute (their prefix not cached), their prompts, their outputs.
    _WAITING_WORK,
    _WAITING_PROMPT,
    _WAITING_OUTPUT,
    # The same of the requests computing their prompt, and how many they are.
    _PREFILL_WORK,
    _PREFILL_PROMPT,
    _PREFILL_OUTPUT,
    _PREFILLING,
    _DECODING,
    _DECODE_LEFT,
    _HELD_TOKENS,
    # Requests that finished over the last tick.
    _FINISHING,
    # The queue a replica reports: waiting, and in the batch, once the last tick's arrivals had their places.
    _SEEN_WAITING,
    _SEEN_RUNNING,
    # Since the last report: first-token latencies (their sum and count), inter-token latencies, prompt
    # tokens of the requests whose prompt was computed, tokens generated.
    _TTFT_SUM,
    _TTFT_COUNT,
    _ITL_SUM,
    _ITL_COUNT,
    _PROMPT_DONE,
    _GENERATED,
    _ROWS,
) = range(21)
# What a report covers, the last rows of the state.
_SINCE_REPORT = slice(_TTFT_SUM, _ROWS)
# No amount below this is anything: it stands between a fluid's zero and division by it.
_NOTHING = 1e-9
# The latency histograms' bounds as arrays.
_TTFT_BOUNDS = numpy.array(TTFT_BUCKETS)
_ITL_BOUNDS = numpy.array(ITL_BUCKETS)


class Arrivals:
    """What a tick brings each engine: requests, the prompt tokens they must compute (those their prefix
    does not find cached), their whole prompts and their outputs, per slot."""

    def __init__(self, capacity: int) -> None:
        # Rows of one array, which the compiled step reads a slot at a time and a tick clears at once.
        self.rows = numpy.zeros((4, capacity))
        self.requests, self.work, self.prompt, self.output = self.rows


class TickLatencies:
    """The first-token latency the engines predict for a tick's arrivals: those who find a place in the batch
    at once, and those who wait for one, with how many of each, per slot."""

    def __init__(
        self,
        at_once_s: numpy.ndarray,
        at_once: numpy.ndarray,
        waiting_s: numpy.ndarray,
        waiting: numpy.ndarray,
    ) -> None:
        self.at_once_s, self.at_once, self.waiting_s, self.waiting = at_once_s, at_once, waiting_s, waiting

    def mean_s(self) -> numpy.ndarray:
        """Per slot, the mean over both (0 where nothing arrived)."""
        count = self.at_once + self.waiting
        total = self.at_once_s * self.at_once + self.waiting_s * self.waiting
        return numpy.divide(total, count, out=numpy.zeros_like(total), where=count > _NOTHING)


class FluidEngines:
    """The engines of a fleet's replicas, a slot each; a slot given back is emptied for the next replica."""

    def __init__(self, profile: EngineProfile, capacity: int = 16) -> None:
        self.profile = profile
        # The profile as the compiled step reads it: its figures in the order _STEP_FIXED_S and the rest name.
        self._figures = numpy.array(
            (
                profile.step_fixed_s,
                profile.prefill_token_s,
                profile.decode_sequence_s,
                profile.context_token_s,
                profile.max_num_seqs,
                profile.max_num_batched_tokens,
            ),
            dtype=numpy.float64,
        )
        self.capacity = 0
        # Slots in use lie below this; only those are advanced.
        self.used = 0
        self._free: list[int] = []
        self._state = numpy.zeros((_ROWS, 0))
        self._grow(capacity)
        # The fleet's latency histograms since the last report (observations per bucket, the last +Inf).
        self._ttft_counts = numpy.zeros(len(TTFT_BUCKETS) + 1)
        self._itl_counts = numpy.zeros(len(ITL_BUCKETS) + 1)

    def add(self) -> int:
        """An empty engine's slot."""
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        self.used = max(self.used, slot + 1)
        return slot

    def remove(self, slot: int) -> None:
        self._state[:, slot] = 0.0
        self._free.append(slot)

    def in_engine(self) -> numpy.ndarray:
        """Requests in each engine: waiting, computing their prompt or decoding."""
        state, used = self._state, self.used
        return state[_WAITING, :used] + state[_PREFILLING, :used] + state[_DECODING, :used]

    def places_freeing(self) -> numpy.ndarray:
        """Requests each engine will finish over the next tick, taken as many as over the last."""
        return self._state[_FINISHING, : self.used]

    def advance(self, tick_s: float, arrivals: Arrivals) -> TickLatencies:
        """Takes the tick's arrivals in and runs every engine for `tick_s` seconds."""
        latencies = _advance(
            self._state,
            arrivals.rows,
            self.used,
            tick_s,
            self._figures,
            _TTFT_BOUNDS,
            _ITL_BOUNDS,
            self._ttft_counts,
            self._itl_counts,
        )
        return TickLatencies(*latencies)

    def report(self, slots: list[int], interval_s: float | None) -> list[PodMetrics]:
        """What the replicas at these slots would show the operator now, since their last report
        (`interval_s` ago; None before the first, as a scraper has no rate then); starts the next interval.

        Each reports the mean of their figures, and the first their latency histograms added up: the
        operator adds the histograms up and averages the rest, so that is the sample the replicas' own
        reports give it, at the cost of one report rather than one a replica."""
        if not slots:
            return []
        rows = self._state[:, slots]
        timed = rows[_TTFT_COUNT] > _NOTHING
        ttft = float(numpy.mean(rows[_TTFT_SUM][timed] / rows[_TTFT_COUNT][timed])) if timed.any() else None
        spaced = rows[_ITL_COUNT] > _NOTHING
        itl = float(numpy.mean(rows[_ITL_SUM][spaced] / rows[_ITL_COUNT][spaced])) if spaced.any() else None
        mean = numpy.mean(rows, axis=1).tolist()
        per_s = 1 / interval_s if interval_s else None
        shared = PodMetrics(
            waiting=mean[_SEEN_WAITING],
            running=mean[_SEEN_RUNNING],
            kv_cache_usage=mean[_HELD_TOKENS] / self.profile.kv_cache_tokens,
            ttft_seconds=ttft,
            queued_prompt_tokens=mean[_WAITING_WORK] + mean[_PREFILL_WORK],
            itl_seconds=itl,
            prompt_tokens_per_s=mean[_PROMPT_DONE] * per_s if per_s is not None else None,
            generation_tokens_per_s=mean[_GENERATED] * per_s if per_s is not None else None,
        )
        first = PodMetrics(
            **{
                **shared.__dict__,
                "ttft_buckets": _buckets(TTFT_BUCKETS, self._ttft_counts),
                "itl_buckets": _buckets(ITL_BUCKETS, self._itl_counts),
            }
        )
        self._state[_SINCE_REPORT] = 0.0
        self._ttft_counts[:] = 0.0
        self._itl_counts[:] = 0.0
        return [first] + [shared] * (len(slots) - 1)

    def _grow(self, capacity: int) -> None:
        grown = numpy.zeros((_ROWS, capacity))
        grown[:, : self.capacity] = self._state
        self._state = grown
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity


def _buckets(bounds: tuple[float, ...], counts: numpy.ndarray) -> Buckets:
    return tuple(zip((*bounds, math.inf), numpy.cumsum(counts).tolist(), strict=True))


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """One of the cohort model's compiled loops (the engines' step here, the fleet's deliveries): each
    replica's arithmetic written for its slot, its divisions as numpy's (no check for a zero, which every
    divisor is kept from). The machine code is cached beside the module, or in the user's cache folder;
    where neither can be written (a read-only install and home), it is compiled at each start instead."""
    try:
        return numba.njit(cache=True, error_model="numpy")(function)
    except RuntimeError:  # numba found nowhere to cache it
        return numba.njit(error_model="numpy")(function)


# The compiled step takes the profile as an array of its figures, in this order.
(
    _STEP_FIXED_S,
    _PREFILL_TOKEN_S,
    _DECODE_SEQUENCE_S,
    _CONTEXT_TOKEN_S,
    _MAX_NUM_SEQS,
    _MAX_NUM_BATCHED_TOKENS,
) = range(6)


@compiled
def _advance(
    state: numpy.ndarray,
    arrivals: numpy.ndarray,
    used: int,
    tick_s: float,
    profile: numpy.ndarray,
    ttft_bounds: numpy.ndarray,
    itl_bounds: numpy.ndarray,
    ttft_counts: numpy.ndarray,
    itl_counts: numpy.ndarray,
) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """Runs every engine for a tick with its arrivals (rows: requests, work, prompt and output tokens);
    returns the arrivals' first-token latencies per slot (TickLatencies' fields) and adds the tick's
    latencies to the histograms."""
    at_once_s, came_in = numpy.zeros(used), numpy.zeros(used)
    waiting_s, came_waiting = numpy.zeros(used), numpy.zeros(used)
    # The tick's observations, each kind in a histogram of its own, added to the counts after the last slot.
    ttft_at_once, ttft_waiting = numpy.zeros(ttft_counts.size), numpy.zeros(ttft_counts.size)
    itl_prefill, itl_decode = numpy.zeros(itl_counts.size), numpy.zeros(itl_counts.size)
    for slot in range(used):
        engine = state[:, slot]
        came, work = arrivals[0, slot], arrivals[1, slot]
        busy_before = engine[_PREFILL_WORK] > _NOTHING or engine[_DECODING] > _NOTHING
        at_once = _admit(engine, arrivals[:, slot], profile)
        each = work / max(came, _NOTHING)
        prompt_tokens, prompt_step_s, prompt_s, decoded, ahead = _compute_prompts(
            engine, tick_s, at_once * each, profile
        )
        finished, decode_step_s, generated = _decode(
            engine, tick_s, prompt_s, decoded, prompt_step_s, profile
        )
        itl_prefill[numpy.searchsorted(itl_bounds, prompt_step_s)] += decoded
        itl_decode[numpy.searchsorted(itl_bounds, decode_step_s)] += max(generated - decoded, 0.0)
        step_s = prompt_step_s if prompt_tokens > _NOTHING else decode_step_s

        # The tick's arrivals' first-token latencies. The middle one of those with a place at once has its
        # prompt end this far into the prompts to compute, and its first token at the end of the step that
        # computes its last token, after the rest of the step in progress.
        waiting = came - at_once
        residual = step_s / 2 if busy_before else 0.0
        position = max(ahead, 0.0) + at_once * each / 2 + each / 2
        own = numpy.ceil(position / max(prompt_tokens, _NOTHING) - 1e-9) * prompt_step_s
        at_once_latency = residual + (own if at_once > _NOTHING else 0.0)
        # Those who wait: the queue ahead at the rate requests finish (estimated where none finished), then
        # the rest of a step, and a step with its prompt.
        finish_rate = finished / tick_s if finished > _NOTHING else _estimated_finish_rate(engine, step_s)
        queue_ahead = max(engine[_WAITING] - waiting / 2, 0.0)
        waiting_latency = queue_ahead / max(finish_rate, _NOTHING) + 1.5 * step_s
        engine[_TTFT_SUM] += at_once_latency * at_once + waiting_latency * waiting
        engine[_TTFT_COUNT] += came
        ttft_at_once[numpy.searchsorted(ttft_bounds, at_once_latency)] += at_once
        ttft_waiting[numpy.searchsorted(ttft_bounds, waiting_latency)] += waiting
        at_once_s[slot], came_in[slot] = at_once_latency, at_once
        waiting_s[slot], came_waiting[slot] = waiting_latency, waiting
    ttft_counts += ttft_at_once
    ttft_counts += ttft_waiting
    itl_counts += itl_prefill
    itl_counts += itl_decode
    return at_once_s, came_in, waiting_s, came_waiting


@compiled
def _admit(engine: numpy.ndarray, arrival: numpy.ndarray, profile: numpy.ndarray) -> float:
    """Queues an engine's arrivals and gives the batch's places to the waiting requests in their order;
    returns how many of the arrivals found a place at once."""
    came = arrival[0]
    waited = engine[_WAITING]
    engine[_WAITING] += came
    for row in range(3):
        engine[_WAITING_WORK + row] += arrival[1 + row]
    # Places in the batch, to the waiting requests in their order: those free, and those the requests
    # finishing over the tick free (as many as finished over the last), which a waiting request takes at
    # once: taken from the tick's start, half of them keep the batch as full over the tick as it is.
    free = profile[_MAX_NUM_SEQS] - engine[_PREFILLING] - engine[_DECODING]
    places = max(free + engine[_FINISHING] / 2, 0.0)
    admitted = min(engine[_WAITING], places)
    share = admitted / max(engine[_WAITING], _NOTHING)
    for row in range(3):
        moved = engine[_WAITING_WORK + row] * share
        engine[_WAITING_WORK + row] -= moved
        engine[_PREFILL_WORK + row] += moved
    engine[_WAITING] -= admitted
    engine[_PREFILLING] += admitted
    # A replica reports its queue as it is with the tick's arrivals placed: requests finish and places fill
    # one by one in an engine, while a tick takes the finishes of its length at once. (The places taken
    # ahead of the finishes are still waiting then.)
    running = engine[_PREFILLING] + engine[_DECODING]
    engine[_SEEN_RUNNING] = min(running, profile[_MAX_NUM_SEQS])
    engine[_SEEN_WAITING] = engine[_WAITING] + running - engine[_SEEN_RUNNING]
    return min(max(admitted - waited, 0.0), came)


@compiled
def _compute_prompts(
    engine: numpy.ndarray, tick_s: float, at_once_work: float, profile: numpy.ndarray
) -> tuple[float, float, float, float, float]:
    """An engine's steps that compute the prompts in its batch, in their order within the budget the
    decoding requests leave; `at_once_work` is the prompt tokens of the arrivals that found a place at once.
    Returns the prompt tokens a step, its length, the seconds of the tick they take, the tokens the decoding
    requests generate meanwhile, and the prompt tokens ahead of those arrivals."""
    decoding = engine[_DECODING]
    backlog = engine[_PREFILL_WORK]
    tokens = min(max(profile[_MAX_NUM_BATCHED_TOKENS] - decoding, 0.0), backlog)
    step_s = _step_s(profile, tokens, decoding, engine[_HELD_TOKENS])
    seconds = min(backlog / max(tokens, _NOTHING) * step_s, tick_s)
    steps = seconds / step_s
    computed = min(tokens * steps, backlog)
    done = computed / max(backlog, _NOTHING) if backlog > _NOTHING else 1.0
    # One whose prompt is computed samples its first token and decodes from then on.
    prompt_share = engine[_PREFILL_PROMPT] * done
    output_share = engine[_PREFILL_OUTPUT] * done
    prompted = engine[_PREFILLING] * done
    engine[_PREFILL_WORK] = backlog - computed
    engine[_PREFILL_PROMPT] -= prompt_share
    engine[_PREFILL_OUTPUT] -= output_share
    engine[_PREFILLING] -= prompted
    engine[_DECODING] += prompted
    engine[_DECODE_LEFT] += max(output_share - prompted, 0.0)
    engine[_HELD_TOKENS] += prompt_share + prompted
    engine[_PROMPT_DONE] += prompt_share
    engine[_GENERATED] += prompted
    return tokens, step_s, seconds, decoding * steps, backlog - at_once_work


@compiled
def _decode(
    engine: numpy.ndarray,
    tick_s: float,
    prompt_s: float,
    decoded: float,
    prompt_step_s: float,
    profile: numpy.ndarray,
) -> tuple[float, float, float]:
    """The rest of an engine's tick in steps of decoding alone (`decoded` tokens were generated in the
    prompts' steps): a token each a step; a request finishes with its share of the tokens left. Returns
    the requests finished, the length of a decoding step and the tokens generated over the tick."""
    decoding = engine[_DECODING]
    left = engine[_DECODE_LEFT]
    step_s = _step_s(profile, 0.0, decoding, engine[_HELD_TOKENS])
    steps = (tick_s - prompt_s) / step_s if decoding > _NOTHING else 0.0
    generated = min(decoded + decoding * steps, left)
    finished = decoding * (generated / max(left, _NOTHING)) if left > _NOTHING else decoding
    engine[_DECODE_LEFT] -= generated
    engine[_HELD_TOKENS] += generated
    engine[_HELD_TOKENS] *= 1.0 - finished / max(decoding, _NOTHING)
    engine[_DECODING] -= finished
    engine[_FINISHING] = finished
    engine[_GENERATED] += generated
    engine[_ITL_SUM] += prompt_step_s * decoded + step_s * (generated - decoded)
    engine[_ITL_COUNT] += generated
    return finished, step_s, generated


@compiled
def _step_s(profile: numpy.ndarray, prompt_tokens: float, decoding: float, context: float) -> float:
    """A step's time by the profile's line (EngineProfile.step_seconds)."""
    return (
        profile[_STEP_FIXED_S]
        + profile[_PREFILL_TOKEN_S] * prompt_tokens
        + profile[_DECODE_SEQUENCE_S] * decoding
        + profile[_CONTEXT_TOKEN_S] * context
    )


@compiled
def _estimated_finish_rate(engine: numpy.ndarray, step_s: float) -> float:
    """Requests a second an engine's batch will finish, where none finished this tick: each takes a step
    for each token its output has left and one for its prompt."""
    running = engine[_PREFILLING] + engine[_DECODING]
    tokens_left = engine[_DECODE_LEFT] + engine[_PREFILL_OUTPUT]
    return running * running / max((tokens_left + running) * step_s, _NOTHING)
