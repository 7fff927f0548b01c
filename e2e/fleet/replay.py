"""A simulator's trace replayed for real: each request streamed through the fleet gateway when it arrives
(open loop, as the trace's clients would send it), its first token timed as a client sees it. The arrivals
are a steady trace's, stretched by a rate decided as the replay goes.

Prompts are token ids, as long as the trace says: the first `shared_prefix_tokens` of a prefix group's
prompts are the same ids (the start the simulator's prefix cache counts as shared), the rest differ from
request to request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Iterator

from kvfleet.runtime.bench.serve_client import ServeRequest, bench_client, send_request
from kvfleet.runtime.bench.serve_report import RequestResult

from kvfleet.simulate.trace import TraceRequest

# Ids below this are the tokenizer's special tokens in the models make-model writes.
FIRST_TOKEN_ID = 16
# How often a rate decided as the replay goes is read: well under a request's gap at the rates replayed here.
RATE_TICK_SECONDS = 0.01
# Connections the client may hold open at once: past any count of requests in flight here.
MOST_IN_FLIGHT = 1024


def trace_workload(
    requests: Iterable[TraceRequest], vocab_size: int, shared_prefix_tokens: int
) -> Iterator[ServeRequest]:
    """The trace's requests as the benchmark client sends them, each made when it is taken: a trace may not
    end."""
    groups: dict[str, list[int]] = {}
    for number, request in enumerate(requests):
        shared = min(shared_prefix_tokens, request.prompt_tokens) if request.prefix_group else 0
        if request.prefix_group not in groups:
            group_ids = _token_ids(random.Random(request.prefix_group), shared_prefix_tokens, vocab_size)
            groups[request.prefix_group] = group_ids
        start = groups[request.prefix_group][:shared]
        rest = _token_ids(random.Random(number), request.prompt_tokens - shared, vocab_size)
        yield ServeRequest(start + rest, request.output_tokens, request.tier, request.arrival_s)


def replay_at_rate(
    url: str,
    model: str,
    workload: Iterable[ServeRequest],
    rate: Callable[[float], float | None],
    timeout_s: float = 300.0,
) -> list[RequestResult]:
    """Sends the workload's requests in order at a rate decided as the replay goes: `rate(seconds)` is the
    requests a second wanted that many seconds after the start, or None to send no more. The workload is a
    trace at one request a second: a request goes out once the rate, summed over the time so far, passes its
    `send_at`, so the trace's random gaps are kept, stretched by the rate (a Poisson trace stays one). The
    results of the requests sent, in order, their start times relative to the replay's start."""

    async def run() -> list[RequestResult]:
        requests = iter(workload)
        async with bench_client(url, MOST_IN_FLIGHT, timeout_s) as client:
            start = last = time.perf_counter()
            expected, sent = 0.0, []
            upcoming = next(requests, None)
            while upcoming is not None:
                now = time.perf_counter()
                wanted = rate(now - start)
                if wanted is None:
                    break
                expected += wanted * (now - last)
                last = now
                while upcoming is not None and upcoming.send_at <= expected:
                    sent.append(asyncio.create_task(send_request(client, model, upcoming)))
                    upcoming = next(requests, None)
                await asyncio.sleep(RATE_TICK_SECONDS)
            results = list(await asyncio.gather(*sent))
        for result in results:
            result.start_time -= start
        return results

    return asyncio.run(run())


def _token_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]
