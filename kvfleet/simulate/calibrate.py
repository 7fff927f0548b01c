"""`kvfleet simulate calibrate`: fits an engine profile's step-time model to a real replica.

Two kinds of timed requests, each a step of known shape: decode steps, timed as the time per output token
while B requests decode together (B sequences, each attending over its prompt and what it has
generated), and prefill steps, timed as the first token of a lone request with a P-token prompt and one
output token (P prompt tokens, and the request's way in and its token's way out, which a decode step's
time per token does not hold: the first-token overhead). The step-time model and that overhead are then
fitted to them by least squares. Prompts are random token ids, so no request hits the prefix cache.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvfleet.simulate.engine import EngineProfile

DECODE_BATCHES = (1, 4, 16)
PREFILL_PROMPTS = (128, 512, 1024)
DECODE_PROMPT_TOKENS = 32
DECODE_OUTPUT_TOKENS = 64


@dataclass(frozen=True)
class StepTiming:
    """One measured step: what it computed and how long it took."""

    prefill_tokens: int
    decode_sequences: int
    context_tokens: int
    seconds: float


def fit_profile(timings: Sequence[StepTiming], limits: EngineProfile) -> EngineProfile:
    """The fixed, per prompt token and per decoding sequence costs, and the first-token overhead, that best
    fit the timings (least squares, none below zero), with the rest of `limits` (its context cost and its
    max_num_seqs, token budget and KV cache). A prefill timing is a first token, so it holds the overhead as
    well; a decode timing does not. The context cost is not fitted: in these timings it grows with the batch
    as the decode cost does, so the two could not be told apart."""
    # A replica that decodes one sequence at a time times one decode batch: its steps' cost is all fixed.
    per_sequence = len({t.decode_sequences for t in timings if t.decode_sequences}) > 1
    rows = [
        (1.0, float(t.prefill_tokens), float(t.decode_sequences == 0))
        + ((float(t.decode_sequences),) if per_sequence else ())
        for t in timings
    ]
    size = len(rows[0])
    matrix = [[sum(row[i] * row[j] for row in rows) for j in range(size)] for i in range(size)]
    vector = [sum(row[i] * t.seconds for row, t in zip(rows, timings, strict=True)) for i in range(size)]
    fixed, prefill, overhead, *decode_cost = (max(0.0, value) for value in _solve(matrix, vector))
    decode = decode_cost[0] if decode_cost else 0.0
    return replace(
        limits,
        step_fixed_s=fixed,
        prefill_token_s=prefill,
        decode_sequence_s=decode,
        first_token_overhead_s=overhead,
    )


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular system raises ValueError."""
    size = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(size)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda row: abs(rows[row][column]))
        if abs(rows[pivot][column]) < 1e-12:
            raise ValueError("the timings do not tell the step-time coefficients apart")
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for row in range(size):
            if row != column:
                factor = rows[row][column] / rows[column][column]
                rows[row] = [a - factor * b for a, b in zip(rows[row], rows[column], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def decode_batches(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batches to time on a replica that runs at most `max_num_seqs` sequences at once: a larger
    batch would queue some of its requests, and their waits would be timed as steps."""
    return tuple(sorted({batch for batch in DECODE_BATCHES if batch < max_num_seqs} | {max_num_seqs}))


def measure(
    url: str, max_num_seqs: int | None = None, model: str | None = None, timeout_s: float = 300.0
) -> list[StepTiming]:
    """Times decode and prefill steps on the replica at `url` (a `kvfleet serve` or any OpenAI server) that
    runs at most `max_num_seqs` sequences at once (None: at least the largest batch timed). `model`: the one
    to time where `url` serves several, as a fleet gateway does (whose time then counts, as it does for its
    clients); by default the first listed."""
    batches = DECODE_BATCHES if max_num_seqs is None else decode_batches(max_num_seqs)
    return asyncio.run(_measure(url, batches, model, timeout_s))


async def _measure(
    url: str, batches: tuple[int, ...], wanted: str | None, timeout_s: float
) -> list[StepTiming]:
    from kvfleet.runtime.bench.serve_client import ServeRequest, bench_client, send_request
    from kvfleet.runtime.bench.workloads import random_requests

    async with bench_client(url, max(batches), timeout_s) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        cards = response.json()["data"]
        card = next((card for card in cards if wanted in (None, card["id"])), None)
        if card is None:
            raise RuntimeError(f"{url} does not serve {wanted}: {[card['id'] for card in cards]}")
        model, vocab = card["id"], int(card.get("vocab_size") or 1000)
        # The first requests of a fresh replica pay for its warm-up: not a step's time.
        (warmup,) = random_requests(1, (16, 16), (4, 4), vocab, seed=len(batches) + len(PREFILL_PROMPTS))
        await send_request(client, model, ServeRequest(warmup.prompt_token_ids, 4, None, 0.0))
        timings: list[StepTiming] = []
        for seed, batch in enumerate(batches):
            shape = (DECODE_PROMPT_TOKENS, DECODE_PROMPT_TOKENS)
            output = (DECODE_OUTPUT_TOKENS, DECODE_OUTPUT_TOKENS)
            prompts = random_requests(batch, shape, output, vocab, seed=seed)
            requests = [ServeRequest(p.prompt_token_ids, p.output_len, None, 0.0) for p in prompts]
            results = await asyncio.gather(*(send_request(client, model, r) for r in requests))
            # A request's time per output token after the first, rather than the gaps between chunks: a
            # stream may carry several tokens in one chunk.
            per_token = [result.tpot for result in results if result.tpot is not None]
            if not per_token:
                raise RuntimeError(f"no streamed tokens from {url}: {[r.error for r in results]}")
            context = batch * (DECODE_PROMPT_TOKENS + DECODE_OUTPUT_TOKENS // 2)
            timings.append(StepTiming(0, batch, context, statistics.median(per_token)))
        for seed, prompt in enumerate(PREFILL_PROMPTS, start=len(batches)):
            (lone,) = random_requests(1, (prompt, prompt), (1, 1), vocab, seed=seed)
            result = await send_request(client, model, ServeRequest(lone.prompt_token_ids, 1, None, 0.0))
            if result.ttft is None:
                raise RuntimeError(f"no first token from {url}: {result.error}")
            timings.append(StepTiming(prompt, 0, 0, result.ttft))
        return timings
