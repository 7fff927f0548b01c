"""A simulator's trace replayed for real: each request streamed through the fleet gateway at its arrival time
(open loop, as the trace's clients would send it), its first token timed as a client sees it.

Prompts are token ids, as long as the trace says: the first `shared_prefix_tokens` of a prefix group's
prompts are the same ids (the start the simulator's prefix cache counts as shared), the rest differ from
request to request.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable

from kvfleet.runtime.bench.serve_client import ServeRequest, bench_client, send_workload
from kvfleet.runtime.bench.serve_report import RequestResult

from kvfleet.simulate.trace import TraceRequest

# Ids below this are the tokenizer's special tokens in the models make-model writes.
FIRST_TOKEN_ID = 16


def trace_workload(
    requests: Iterable[TraceRequest], vocab_size: int, shared_prefix_tokens: int
) -> list[ServeRequest]:
    """The trace's requests as the benchmark client sends them."""
    groups: dict[str, list[int]] = {}
    workload = []
    for number, request in enumerate(requests):
        shared = min(shared_prefix_tokens, request.prompt_tokens) if request.prefix_group else 0
        if request.prefix_group not in groups:
            group_ids = _token_ids(random.Random(request.prefix_group), shared_prefix_tokens, vocab_size)
            groups[request.prefix_group] = group_ids
        start = groups[request.prefix_group][:shared]
        rest = _token_ids(random.Random(number), request.prompt_tokens - shared, vocab_size)
        workload.append(ServeRequest(start + rest, request.output_tokens, request.tier, request.arrival_s))
    return workload


def replay(
    url: str, model: str, workload: list[ServeRequest], timeout_s: float = 300.0
) -> list[RequestResult]:
    """Sends every request at its time to the OpenAI server at `url`; each one's result, in trace order."""

    async def run() -> list[RequestResult]:
        async with bench_client(url, max(len(workload), 1), timeout_s) as client:
            results, _ = await send_workload(client, model, workload)
            return results

    return asyncio.run(run())


def _token_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]
