"""`kvfleet simulate calibrate`: fits an engine profile's step-time model to a real replica.

Four kinds of timed requests, each a step of known shape:
- decode steps, timed as the time per output token while B requests decode together (B sequences, each
  attending over its prompt and what it has generated);
- prefill steps, timed as the first token of a lone request with a P-token prompt and one output token (P
  prompt tokens, and the request's way in and its token's way out, which a decode step's time per token does
  not hold: the first-token overhead);
- first tokens beside a decode batch: the same lone prompt sent while B requests decode, which waits for the
  step in progress, joins the next, and is taken in while the server streams the batch's tokens;
- first tokens after the replica sat idle a while, which pay for waking it (caches, threads, clocks).
The step-time model and the overhead are fitted to the first two by least squares; the overhead per
sequence beside to what those first tokens took beyond the fitted model, and the wake to what the first
tokens after a pause took beyond the same prompt's first tokens timed without one. Prompts are random token
ids, so no request hits the prefix cache.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy

from kvfleet.simulate.engine import EngineProfile

if TYPE_CHECKING:
    from kvfleet.runtime.bench.serve_client import ServeRequest
    from kvfleet.runtime.bench.serve_report import RequestResult

DECODE_BATCHES = (1, 4, 16)
# From a prompt as short as a chat turn's new tokens after a prefix cache hit to a long one: a prefill's
# time grows faster than its prompt (its attention), so a line through long prompts alone misses short ones.
PREFILL_PROMPTS = (16, 128, 512, 1024)
# The prompt of the first tokens timed beside a decode batch, and after a pause.
LONE_PROMPT_TOKENS = 128
DECODE_PROMPT_TOKENS = 32
DECODE_OUTPUT_TOKENS = 64
# Prompts tried for a first token a client sees as text.
FIRST_TOKEN_TRIES = 5
# Each prompt's lone first token, and first tokens beside a decode batch and after each idle pause, are timed
# this many times (the median counts).
REPEATS = 3
# The idle pauses a first token is timed after: the wake grows with the pause (tens of milliseconds after a
# second on a virtual machine's CPUs), so it is a curve.
WAKE_PAUSES_S = (0.1, 0.3, 1.0, 3.0)
# The curves' time constants tried, 20 a decade from 10 ms to a third of the longest pause: a curve is then
# within 5% of its height at that pause, so it does not grow much past what was measured.
WAKE_AFTER_GRID_S = tuple(
    after
    for after in (0.01 * 10 ** (step / 20) for step in range(61))
    if after <= max(WAKE_PAUSES_S) / 3 + 1e-9
)


@dataclass(frozen=True)
class StepTiming:
    """One measured step: what it computed and how long it took."""

    prefill_tokens: int
    decode_sequences: int
    context_tokens: int
    seconds: float
    # The seconds the replica sat idle before it (a first token timed after a pause).
    idle_s: float = 0.0

    @property
    def kind(self) -> str:
        if not self.prefill_tokens:
            return "decode"
        if self.idle_s:
            return "woken"
        return "beside" if self.decode_sequences else "prefill"


def fit_profile(timings: Sequence[StepTiming], limits: EngineProfile) -> EngineProfile:
    """The profile that best fits the timings, with the rest of `limits` (its context cost and its
    max_num_seqs, token budget and KV cache): the step-time model and first-token overhead from the decode
    and prefill timings (the median of each shape's, so that one request held up by something else does
    not pull the line), then the overhead per sequence beside and the wake from what the others took beyond
    that model (where none of those was timed, the limits' value stays)."""
    if any(t.seconds <= 0 for t in timings):
        raise ValueError(f"a timing of no time: {min(timings, key=lambda t: t.seconds)}")
    steps = _medians([t for t in timings if t.kind in ("decode", "prefill")])
    profile = _fit_steps(steps, limits)
    beside = [t for t in timings if t.kind == "beside"]
    if beside:
        per_sequence = _overhead_per_sequence(profile, beside)
        profile = replace(profile, first_token_overhead_per_sequence_s=per_sequence)
    woken = [t for t in timings if t.kind == "woken"]
    if woken:
        lone_s = {t.prefill_tokens: t.seconds for t in steps if t.kind == "prefill"}
        profile = _fit_wake(profile, woken, lone_s)
    return profile


def _medians(timings: Sequence[StepTiming]) -> list[StepTiming]:
    """One timing a shape (what a step computed), its seconds the median of that shape's timings."""
    by_shape: dict[tuple[int, int, int], list[float]] = {}
    for t in timings:
        by_shape.setdefault((t.prefill_tokens, t.decode_sequences, t.context_tokens), []).append(t.seconds)
    return [StepTiming(*shape, statistics.median(seconds)) for shape, seconds in by_shape.items()]


def describe(profile: EngineProfile) -> str:
    """A fitted profile in words, as calibration prints it."""
    return (
        f"fixed {profile.step_fixed_s * 1000:.2f} ms, {profile.prefill_token_s * 1e6:.1f} us per prompt "
        f"token, {profile.decode_sequence_s * 1000:.3f} ms per decoding sequence; a first token "
        f"{profile.first_token_overhead_s * 1000:.2f} ms more, and "
        f"{profile.first_token_overhead_per_sequence_s * 1000:.2f} ms per sequence beside it; a step after "
        f"a long idle {profile.wake_s * 1000:.2f} ms more (time constant {profile.wake_after_s:.2f} s)"
    )


def _fit_steps(timings: Sequence[StepTiming], limits: EngineProfile) -> EngineProfile:
    """The fixed, per prompt token and per decoding sequence costs, and the first-token overhead, by least
    squares of the relative errors with none below zero. A prefill timing is a first token, so it holds the
    overhead as well; a decode timing does not. The context cost is not fitted: in these timings it grows with
    the batch as the decode cost does, so the two could not be told apart.

    Relative, because the timings span three orders of magnitude: a model whose prefill of 1,024 tokens takes
    0.7 s and whose decode step takes 9 ms has its fixed cost set by the prefills' curve in an absolute fit
    (prefill grows faster than linearly, its attention with the prompt), and its decode step, what most of a
    request's steps are, comes out 40% off."""
    # A replica that decodes one sequence at a time times one decode batch: its steps' cost is all fixed.
    per_sequence = len({t.decode_sequences for t in timings if t.decode_sequences}) > 1
    rows = [
        tuple(
            value / t.seconds
            for value in (1.0, float(t.prefill_tokens), float(t.decode_sequences == 0))
            + ((float(t.decode_sequences),) if per_sequence else ())
        )
        for t in timings
    ]
    fixed, prefill, overhead, *decode_cost = _nonnegative_least_squares(rows, [1.0] * len(timings))
    decode = decode_cost[0] if decode_cost else 0.0
    return replace(
        limits,
        step_fixed_s=fixed,
        prefill_token_s=prefill,
        decode_sequence_s=decode,
        first_token_overhead_s=overhead,
    )


def _overhead_per_sequence(profile: EngineProfile, beside: Sequence[StepTiming]) -> float:
    """The median over the timings of what each first token took beyond the model, per sequence beside it.
    The model's first token waits half the decode step in progress (it arrives at a random moment of it),
    then computes its prompt in a step with the batch."""
    extra = []
    for timing in beside:
        batch, context = timing.decode_sequences, timing.context_tokens
        in_progress = profile.step_seconds(0, batch, context) / 2
        step = profile.step_seconds(timing.prefill_tokens, batch, context)
        extra.append((timing.seconds - in_progress - step - profile.first_token_overhead_s) / batch)
    return max(0.0, statistics.median(extra))


def _fit_wake(profile: EngineProfile, woken: Sequence[StepTiming], lone_s: dict[int, float]) -> EngineProfile:
    """The wake curve, wake_s * (1 - exp(-idle / wake_after_s)), that best fits the median of what the first
    tokens after each pause took beyond the median of the same prompt's first tokens without a pause
    (`lone_s`, by their prompt tokens), not beyond the fitted model, whose error at that prompt would count as
    wake: for each time constant of the grid, the least-squares height (not below zero); the pair with the
    least squared error."""
    by_pause: dict[float, list[float]] = {}
    for timing in woken:
        if timing.prefill_tokens not in lone_s:
            raise ValueError(f"no first token of {timing.prefill_tokens} prompt tokens timed without a pause")
        by_pause.setdefault(timing.idle_s, []).append(timing.seconds - lone_s[timing.prefill_tokens])
    pauses = list(by_pause)
    extras = [statistics.median(by_pause[pause]) for pause in pauses]

    def fitted(after: float) -> tuple[float, float, float]:
        """The squared error, the height and the time constant of the best curve with this constant."""
        shape = [-math.expm1(-pause / after) for pause in pauses]
        height = max(0.0, sum(f * e for f, e in zip(shape, extras, strict=True)) / sum(f * f for f in shape))
        return sum((height * f - e) ** 2 for f, e in zip(shape, extras, strict=True)), height, after

    _, height, after = min(fitted(after) for after in WAKE_AFTER_GRID_S)
    return replace(profile, wake_s=height, wake_after_s=after)


def _nonnegative_least_squares(rows: list[tuple[float, ...]], targets: list[float]) -> list[float]:
    """The coefficients, none below zero, whose sum of squared errors is least: the best unconstrained fit
    over each subset of the coefficients left free (the others at zero) that has none negative. Zeroing a
    coefficient the plain fit made negative is not that: the others then keep the values they took to offset
    it (a decode step timed faster at two sequences than at one, by chance, gave a negative cost a sequence
    and a fixed cost above both timings). Exact, and cheap for the four coefficients here."""
    matrix, wanted = numpy.array(rows), numpy.array(targets)
    size = matrix.shape[1]
    if numpy.linalg.matrix_rank(matrix) < size:
        raise ValueError("the timings do not tell the step-time coefficients apart")
    best, least_error = numpy.zeros(size), float(wanted @ wanted)
    for free in itertools.product((False, True), repeat=size):
        columns = [index for index, is_free in enumerate(free) if is_free]
        if not columns:
            continue
        solution = numpy.linalg.lstsq(matrix[:, columns], wanted, rcond=None)[0]
        if (solution < 0).any():
            continue
        coefficients = numpy.zeros(size)
        coefficients[columns] = solution
        residual = matrix @ coefficients - wanted
        if (error := float(residual @ residual)) < least_error:
            best, least_error = coefficients, error
    return best.tolist()


def decode_batches(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batches to time on a replica that runs at most `max_num_seqs` sequences at once: a larger
    batch would queue some of its requests, and their waits would be timed as steps."""
    return tuple(sorted({batch for batch in DECODE_BATCHES if batch < max_num_seqs} | {max_num_seqs}))


def measure(
    url: str, max_num_seqs: int | None = None, model: str | None = None, timeout_s: float = 300.0
) -> list[StepTiming]:
    """Times decode and prefill steps, first tokens beside decode batches and after idle pauses, on the
    replica at `url` (a `kvfleet serve` or any OpenAI server) that runs at most `max_num_seqs` sequences at
    once (None: at least the largest batch timed). `model`: the one to time where `url` serves several, as a
    fleet gateway does (whose time then counts, as it does for its clients); by default the first listed."""
    batches = DECODE_BATCHES if max_num_seqs is None else decode_batches(max_num_seqs)
    return asyncio.run(_measure(url, batches, model, timeout_s))


async def _measure(
    url: str, batches: tuple[int, ...], wanted: str | None, timeout_s: float
) -> list[StepTiming]:
    from kvfleet.runtime.bench.serve_client import bench_client, send_request

    async with bench_client(url, max(batches) + 1, timeout_s) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        cards = response.json()["data"]
        card = next((card for card in cards if wanted in (None, card["id"])), None)
        if card is None:
            raise RuntimeError(f"{url} does not serve {wanted}: {[card['id'] for card in cards]}")
        send = functools.partial(send_request, client, card["id"])
        timer = _Timer(send, url, int(card.get("vocab_size") or 1000))
        # The first requests of a fresh replica pay for its warm-up: not a step's time.
        await timer.first_token(16)
        timings: list[StepTiming] = []
        for batch in batches:
            decode, lasting_s = await timer.decode(batch)
            timings.append(decode)
            # Only where a place is left for the first token beside the batch.
            if batch < max(batches):
                timings += [await timer.beside(batch, lasting_s) for _ in range(REPEATS)]
        timings += [await timer.first_token(prompt) for prompt in PREFILL_PROMPTS for _ in range(REPEATS)]
        for pause in WAKE_PAUSES_S:
            for _ in range(REPEATS):
                await asyncio.sleep(pause)
                timings.append(replace(await timer.first_token(LONE_PROMPT_TOKENS), idle_s=pause))
        return timings


class _Timer:
    """Sends the calibration's requests (through `send`, to one model), each with a prompt of its own (no
    prefix cache hit)."""

    def __init__(
        self, send: Callable[[ServeRequest], Awaitable[RequestResult]], url: str, vocab_size: int
    ) -> None:
        self._send_request, self.url, self.vocab_size = send, url, vocab_size
        self._seeds = itertools.count()

    async def first_token(self, prompt: int) -> StepTiming:
        """A lone first token of a `prompt`-token prompt."""
        return StepTiming(prompt, 0, 0, await self._first_token_s(prompt))

    async def decode(self, batch: int) -> tuple[StepTiming, float]:
        """The time per output token of `batch` requests decoding together, and how long they took."""
        results = await self._send(batch, DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS)
        # A request's time per output token after the first, rather than the gaps between chunks: a stream
        # may carry several tokens in one chunk.
        per_token = [result.tpot for result in results if result.tpot is not None]
        if not per_token:
            raise RuntimeError(f"no streamed tokens from {self.url}: {[r.error for r in results]}")
        lasting = statistics.median(result.latency for result in results if result.latency is not None)
        return StepTiming(0, batch, self._context(batch), statistics.median(per_token)), lasting

    async def beside(self, batch: int, lasting_s: float) -> StepTiming:
        """A first token sent a quarter into the decoding of `batch` requests that last `lasting_s`."""
        decoding = asyncio.create_task(self._send(batch, DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS))
        await asyncio.sleep(lasting_s / 4)
        seconds = await self._first_token_s(PREFILL_PROMPTS[0])
        await decoding
        return StepTiming(PREFILL_PROMPTS[0], batch, self._context(batch), seconds)

    async def _first_token_s(self, prompt: int) -> float:
        """The time to a first token of a `prompt`-token prompt. A token may decode to no text (a piece of a
        character): the client sees nothing then, and another prompt is timed."""
        for _ in range(FIRST_TOKEN_TRIES):
            (result,) = await self._send(1, prompt, 1)
            if result.error is not None:
                raise RuntimeError(f"no first token from {self.url}: {result.error}")
            if result.ttft is not None:
                return result.ttft
        raise RuntimeError(f"{FIRST_TOKEN_TRIES} prompts' first tokens from {self.url} were not text")

    @staticmethod
    def _context(batch: int) -> int:
        """What a decode batch attends over, halfway through its output."""
        return batch * (DECODE_PROMPT_TOKENS + DECODE_OUTPUT_TOKENS // 2)

    async def _send(self, count: int, prompt: int, output: int) -> list[RequestResult]:
        """Sends `count` requests at once; their results."""
        from kvfleet.runtime.bench.serve_client import ServeRequest
        from kvfleet.runtime.bench.workloads import random_requests

        shape, seed = (prompt, prompt), next(self._seeds)
        requests = random_requests(count, shape, (output, output), self.vocab_size, seed=seed)
        sent = [ServeRequest(r.prompt_token_ids, output, None, 0.0) for r in requests]
        return list(await asyncio.gather(*(self._send_request(request) for request in sent)))
