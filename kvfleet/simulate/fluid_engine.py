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

What it leaves out of the request model: the KV cache's bound (no preemption; the profile's cache holds a
full batch of the traces' lengths many times over) and the order within a tick (a tick's arrivals come
together at its start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from kvfleet.contract.metrics import ITL_BUCKETS, TTFT_BUCKETS
from kvfleet.operator.autoscaler import Buckets, PodMetrics
from kvfleet.simulate.engine import EngineProfile

# The engines' state, a row each of one array, a replica's figures at its slot.
_FIELDS = (
    "waiting",
    "waiting_work",
    "waiting_prompt",
    "waiting_output",
    "prefill_work",
    "prefill_prompt",
    "prefill_output",
    "prefilling",
    "decoding",
    "decode_left",
    "held_tokens",
    # Requests that finished over the last tick.
    "finishing",
    # The queue a replica reports: waiting, and in the batch, once the last tick's arrivals had their places.
    "seen_waiting",
    "seen_running",
    # Since the last report: first-token latencies (their sum and count), inter-token latencies, prompt
    # tokens of the requests whose prompt was computed, tokens generated.
    "ttft_sum",
    "ttft_count",
    "itl_sum",
    "itl_count",
    "prompt_done",
    "generated",
)
# The waiting requests' tokens (work, prompt, output) and the prefilling ones', each three rows of the state
# in that order, moved together as requests get their places.
_WAITING_TOKENS = slice(_FIELDS.index("waiting_work"), _FIELDS.index("waiting_output") + 1)
_PREFILL_TOKENS = slice(_FIELDS.index("prefill_work"), _FIELDS.index("prefill_output") + 1)
# The prefilling requests' prompt and output tokens, and the requests: what goes on to decode as a share of
# them has its prompt computed.
_PREFILLED = slice(_FIELDS.index("prefill_prompt"), _FIELDS.index("prefilling") + 1)
# What a report covers, the last rows of the state.
_SINCE_REPORT = slice(_FIELDS.index("ttft_sum"), len(_FIELDS))
# No amount below this is anything: it stands between a fluid's zero and division by it.
_NOTHING = 1e-9
# The latency histograms' bounds as arrays, made once rather than from the tuples at each of a tick's four
# histograms.
_TTFT_BOUNDS = numpy.array(TTFT_BUCKETS)
_ITL_BOUNDS = numpy.array(ITL_BUCKETS)


class Arrivals:
    """What a tick brings each engine: requests, the prompt tokens they must compute (those their prefix
    does not find cached), their whole prompts and their outputs, per slot."""

    def __init__(self, capacity: int) -> None:
        # Rows of one array, so that a tick's tokens go in, and all of it is cleared, in one operation each.
        self.rows = numpy.zeros((4, capacity))
        self.requests, self.work, self.prompt, self.output = self.rows
        # The work, prompt and output rows.
        self.tokens = self.rows[1:]


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


@dataclass(frozen=True)
class _PromptSteps:
    """A tick's steps that compute prompts, per slot: the prompt tokens a step, its length, the seconds of the
    tick they take, the tokens the decoding requests generate meanwhile, and the prompt tokens ahead of the
    tick's arrivals that found a place at once."""

    tokens: numpy.ndarray
    step_s: numpy.ndarray
    seconds: numpy.ndarray
    decoded: numpy.ndarray
    ahead: numpy.ndarray


class FluidEngines:
    """The engines of a fleet's replicas, a slot each; a slot given back is emptied for the next replica."""

    def __init__(self, profile: EngineProfile, capacity: int = 16) -> None:
        self.profile = profile
        self.capacity = 0
        # Slots in use lie below this; only those are advanced.
        self.used = 0
        self._free: list[int] = []
        # The state, a row a field (_FIELDS), and its rows by name.
        self._state = numpy.zeros((len(_FIELDS), 0))
        self._arrays: dict[str, numpy.ndarray] = {}
        self._viewed = (0, 0)
        self._view: dict[str, numpy.ndarray] = {}
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
        used, a = self.used, self._arrays
        return a["waiting"][:used] + a["prefilling"][:used] + a["decoding"][:used]

    def places_freeing(self) -> numpy.ndarray:
        """Requests each engine will finish over the next tick, taken as many as over the last."""
        return self._arrays["finishing"][: self.used]

    def advance(self, tick_s: float, arrivals: Arrivals) -> TickLatencies:
        """Takes the tick's arrivals in and runs every engine for `tick_s` seconds."""
        a = self._views()
        used = self.used
        came, work = arrivals.requests[:used], arrivals.work[:used]
        busy_before = (a["prefill_work"] > _NOTHING) | (a["decoding"] > _NOTHING)
        came_in = self._admit(a, arrivals)
        each = _share(work, came)
        prompts = self._compute_prompts(a, tick_s, came_in * each)
        finished, step_s = self._decode(a, tick_s, prompts)

        # The tick's arrivals' first-token latencies.
        came_waiting = came - came_in
        residual = numpy.where(busy_before, step_s / 2, 0.0)
        # The middle one's prompt ends this far into the prompts to compute; it has its first token at the
        # end of the step that computes its last token.
        position = numpy.maximum(prompts.ahead, 0.0) + came_in * each / 2 + each / 2
        own = numpy.ceil(position / numpy.maximum(prompts.tokens, _NOTHING) - 1e-9) * prompts.step_s
        at_once_s = residual + numpy.where(came_in > _NOTHING, own, 0.0)
        finish_rate = finished / tick_s
        finishing = finished > _NOTHING
        # Estimated only where an engine finished nothing (in a busy fleet, none).
        if not finishing.all():
            finish_rate = numpy.where(finishing, finish_rate, _estimated_finish_rate(a, step_s))
        queue_ahead = numpy.maximum(a["waiting"] - came_waiting / 2, 0.0)
        # Once it has a place: the rest of a step, and a step with its prompt.
        waiting_s = queue_ahead / numpy.maximum(finish_rate, _NOTHING) + 1.5 * step_s
        a["ttft_sum"] += at_once_s * came_in + waiting_s * came_waiting
        a["ttft_count"] += came
        self._ttft_counts += _histogram(_TTFT_BOUNDS, at_once_s, came_in)
        self._ttft_counts += _histogram(_TTFT_BOUNDS, waiting_s, came_waiting)
        return TickLatencies(at_once_s, came_in, waiting_s, came_waiting)

    def _admit(self, a: dict[str, numpy.ndarray], arrivals: Arrivals) -> numpy.ndarray:
        """Queues the tick's arrivals and gives the batch's places to the waiting requests in their order;
        returns how many of the arrivals found a place at once, per slot."""
        profile, used = self.profile, self.used
        came = arrivals.requests[:used]
        waited = a["waiting"].copy()
        a["waiting"] += came
        a["waiting_tokens"] += arrivals.tokens[:, :used]

        # Places in the batch, to the waiting requests in their order: those free, and those the requests
        # finishing over the tick free (as many as finished over the last), which a waiting request takes at
        # once: taken from the tick's start, half of them keep the batch as full over the tick as it is.
        places = numpy.maximum(
            profile.max_num_seqs - a["prefilling"] - a["decoding"] + a["finishing"] / 2, 0.0
        )
        admitted = numpy.minimum(a["waiting"], places)
        moved = a["waiting_tokens"] * _share(admitted, a["waiting"])
        a["waiting_tokens"] -= moved
        a["prefill_tokens"] += moved
        a["waiting"] -= admitted
        a["prefilling"] += admitted
        # A replica reports its queue as it is with the tick's arrivals placed: requests finish and places
        # fill one by one in an engine, while a tick takes the finishes of its length at once.
        # (The places taken ahead of the finishes are still waiting then.)
        running = a["prefilling"] + a["decoding"]
        numpy.minimum(running, profile.max_num_seqs, out=a["seen_running"])
        a["seen_waiting"][:] = a["waiting"] + running - a["seen_running"]
        # numpy.clip's own arithmetic, without its Python-level wrapper.
        return numpy.minimum(numpy.maximum(admitted - waited, 0.0), came)

    def _compute_prompts(
        self, a: dict[str, numpy.ndarray], tick_s: float, came_in_work: numpy.ndarray
    ) -> _PromptSteps:
        """The steps that compute the prompts in the batch, in their order within the budget the decoding
        requests leave; `came_in_work` is the prompt tokens of the arrivals that found a place at once."""
        profile = self.profile
        decoding = a["decoding"].copy()
        backlog = a["prefill_work"]
        prompt_tokens = numpy.minimum(numpy.maximum(profile.max_num_batched_tokens - decoding, 0.0), backlog)
        prefill_step_s = _step_s(profile, prompt_tokens, decoding, a["held_tokens"])
        prefill_s = numpy.minimum(_share(backlog, prompt_tokens) * prefill_step_s, tick_s)
        prefill_steps = prefill_s / prefill_step_s
        ahead = backlog - came_in_work
        computed = numpy.minimum(prompt_tokens * prefill_steps, backlog)
        done = numpy.where(backlog > _NOTHING, _share(computed, backlog), 1.0)
        # One whose prompt is computed samples its first token and decodes from then on.
        moving = a["prefilled"] * done
        prompt_share, output_share, prompted = moving
        backlog -= computed
        a["prefilled"] -= moving
        a["decoding"] += prompted
        a["decode_left"] += numpy.maximum(output_share - prompted, 0.0)
        a["held_tokens"] += prompt_share + prompted
        a["prompt_done"] += prompt_share
        a["generated"] += prompted
        return _PromptSteps(prompt_tokens, prefill_step_s, prefill_s, decoding * prefill_steps, ahead)

    def _decode(
        self, a: dict[str, numpy.ndarray], tick_s: float, prompts: _PromptSteps
    ) -> tuple[numpy.ndarray, numpy.ndarray]:
        """The rest of the tick in steps of decoding alone: a token each a step; a request finishes with its
        share of the tokens left. Returns the requests finished and the length of the tick's steps."""
        decode_step_s = _step_s(self.profile, 0.0, a["decoding"], a["held_tokens"])
        decode_steps = numpy.where(a["decoding"] > _NOTHING, (tick_s - prompts.seconds) / decode_step_s, 0.0)
        during_prefill = prompts.decoded
        generated = numpy.minimum(during_prefill + a["decoding"] * decode_steps, a["decode_left"])
        decoders = a["decoding"].copy()
        finished = numpy.where(
            a["decode_left"] > _NOTHING, decoders * _share(generated, a["decode_left"]), decoders
        )
        a["decode_left"] -= generated
        a["held_tokens"] += generated
        a["held_tokens"] *= 1.0 - _share(finished, decoders)
        a["decoding"] -= finished
        a["finishing"][:] = finished
        a["generated"] += generated
        a["itl_sum"] += prompts.step_s * during_prefill + decode_step_s * (generated - during_prefill)
        a["itl_count"] += generated
        self._itl_counts += _histogram(_ITL_BOUNDS, prompts.step_s, during_prefill)
        self._itl_counts += _histogram(
            _ITL_BOUNDS, decode_step_s, numpy.maximum(generated - during_prefill, 0.0)
        )
        return finished, numpy.where(prompts.tokens > _NOTHING, prompts.step_s, decode_step_s)

    def _views(self) -> dict[str, numpy.ndarray]:
        """The arrays over the slots in use, made again only when those change."""
        if self._viewed != (self.used, self.capacity):
            self._viewed = (self.used, self.capacity)
            self._view = {name: array[: self.used] for name, array in self._arrays.items()}
            self._view["waiting_tokens"] = self._state[_WAITING_TOKENS, : self.used]
            self._view["prefill_tokens"] = self._state[_PREFILL_TOKENS, : self.used]
            self._view["prefilled"] = self._state[_PREFILLED, : self.used]
        return self._view

    def report(self, slots: list[int], interval_s: float | None) -> list[PodMetrics]:
        """What the replicas at these slots would show the operator now, since their last report
        (`interval_s` ago; None before the first, as a scraper has no rate then); starts the next interval.

        Each reports the mean of their figures, and the first their latency histograms added up: the
        operator adds the histograms up and averages the rest, so that is the sample the replicas' own
        reports give it, at the cost of one report rather than one a replica."""
        if not slots:
            return []
        a = dict(zip(_FIELDS, self._state[:, slots], strict=True))
        timed = a["ttft_count"] > _NOTHING
        ttft = float(numpy.mean(a["ttft_sum"][timed] / a["ttft_count"][timed])) if timed.any() else None
        spaced = a["itl_count"] > _NOTHING
        itl = float(numpy.mean(a["itl_sum"][spaced] / a["itl_count"][spaced])) if spaced.any() else None
        mean = {name: float(numpy.mean(values)) for name, values in a.items()}
        per_s = 1 / interval_s if interval_s else None
        shared = PodMetrics(
            waiting=mean["seen_waiting"],
            running=mean["seen_running"],
            kv_cache_usage=mean["held_tokens"] / self.profile.kv_cache_tokens,
            ttft_seconds=ttft,
            queued_prompt_tokens=mean["waiting_work"] + mean["prefill_work"],
            itl_seconds=itl,
            prompt_tokens_per_s=mean["prompt_done"] * per_s if per_s is not None else None,
            generation_tokens_per_s=mean["generated"] * per_s if per_s is not None else None,
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
        grown = numpy.zeros((len(_FIELDS), capacity))
        grown[:, : self.capacity] = self._state
        self._state = grown
        self._arrays = dict(zip(_FIELDS, grown, strict=True))
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity


def _step_s(
    profile: EngineProfile,
    prompt_tokens: numpy.ndarray | float,
    decoding: numpy.ndarray,
    context: numpy.ndarray,
) -> numpy.ndarray:
    """A step's time by the profile's line (EngineProfile.step_seconds, on arrays)."""
    return profile.step_seconds(prompt_tokens, decoding, context)  # type: ignore[arg-type,return-value]


def _share(part: numpy.ndarray, whole: numpy.ndarray) -> numpy.ndarray:
    """part / whole, of a part that is nothing where its whole is (0 then)."""
    return part / numpy.maximum(whole, _NOTHING)


def _estimated_finish_rate(a: dict[str, numpy.ndarray], step_s: numpy.ndarray) -> numpy.ndarray:
    """Requests a second the batch will finish, where none finished this tick: each takes a step for each
    token its output has left and one for its prompt."""
    running = a["prefilling"] + a["decoding"]
    tokens_left = a["decode_left"] + a["prefill_output"]
    return _share(running * running, (tokens_left + running) * step_s)


def _histogram(bounds: numpy.ndarray, seconds: numpy.ndarray, counts: numpy.ndarray) -> numpy.ndarray:
    """Observations per bucket (i: above bound i-1, up to bound i), as a replica's histogram takes them."""
    return numpy.bincount(
        bounds.searchsorted(seconds, side="left"), weights=counts, minlength=bounds.size + 1
    )


def _buckets(bounds: tuple[float, ...], counts: numpy.ndarray) -> Buckets:
    return tuple(zip((*bounds, math.inf), numpy.cumsum(counts).tolist(), strict=True))
