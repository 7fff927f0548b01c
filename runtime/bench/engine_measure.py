"""How offline throughput and decode step time are measured, for any engine with a `generate`.

Only the standard library is imported here: vLLM's side of the comparison (`bench/vllm/engine_timing.py`)
loads this file from vLLM's own environment, so that both engines are measured by the same code.

- offline: after a warm-up on the first few requests, the whole workload is submitted at once (greedy,
  every request producing exactly its length); output tokens per second of wall time.
- decode step: `b` requests of a short prompt generate `max_tokens` tokens, and again only one token; the
  difference is `max_tokens - 1` decode steps of the whole batch. Each is timed `repeats` times and the
  fastest run is kept, so that other work on the machine inflates the figure as little as possible.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

OFFLINE_WARMUP_REQUESTS = 8

# (prompts, output length of each) -> output tokens produced; runs them all to completion, greedy,
# ignoring end-of-sequence tokens.
Generate = Callable[[list[list[int]], list[int]], int]


def measure(generate: Generate, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's offline throughput and decode step times (ms per step, by batch size)."""
    prompts = [r["prompt_token_ids"] for r in plan["offline"]]
    output_lens = [r["output_len"] for r in plan["offline"]]
    generate(prompts[:OFFLINE_WARMUP_REQUESTS], output_lens[:OFFLINE_WARMUP_REQUESTS])
    start = time.perf_counter()
    produced = generate(prompts, output_lens)
    seconds = time.perf_counter() - start
    if produced != sum(output_lens):
        raise RuntimeError(
            f"the engine produced {produced} tokens, the workload asked for {sum(output_lens)}"
        )
    decode = plan["decode"]
    max_tokens = decode["max_tokens"]

    def fastest(batch_prompts: list[list[int]], output_len: int) -> float:
        runs = []
        for _ in range(decode["repeats"]):
            run_start = time.perf_counter()
            generate(batch_prompts, [output_len] * len(batch_prompts))
            runs.append(time.perf_counter() - run_start)
        return min(runs)

    step_ms = {}
    for batch in decode["batch_sizes"]:
        batch_prompts = decode["prompts"][:batch]
        decode_seconds = fastest(batch_prompts, max_tokens) - fastest(batch_prompts, 1)
        step_ms[str(batch)] = decode_seconds / (max_tokens - 1) * 1e3
    return {
        "offline": {"seconds": seconds, "output_tokens": produced, "tokens_per_second": produced / seconds},
        "decode_step_ms": step_ms,
    }
