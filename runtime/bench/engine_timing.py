"""kvfleet's side of the comparison with vLLM: the plan both engines run, and kvfleet running it.

The plan (JSON) fixes everything both engines do: the engine settings, a seeded offline workload of
token-id prompts, and the prompts of the decode-step measurement. vLLM runs the same plan from its own
environment (`bench/vllm/engine_timing.py`); both measure it with `engine_measure.measure`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from kvfleet.runtime.bench.engine_measure import measure
from kvfleet.runtime.bench.workloads import random_requests
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams


def make_plan(
    model: str,
    *,
    vocab_size: int,
    max_num_seqs: int,
    cpu_kv_cache_space: int,
    num_requests: int = 64,
    batch_sizes: tuple[int, ...] = (1, 8),
    decode_prompt_len: int = 32,
    decode_max_tokens: int = 256,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    offline = random_requests(num_requests, (16, 256), (16, 128), vocab_size, seed=seed)
    decode_prompts = random_requests(
        max(batch_sizes), (decode_prompt_len, decode_prompt_len), (1, 1), vocab_size, seed=seed + 1
    )
    return {
        "model": model,
        "dtype": "float32",
        "max_num_seqs": max_num_seqs,
        "cpu_kv_cache_space": cpu_kv_cache_space,
        "seed": seed,
        "offline": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in offline],
        "decode": {
            "batch_sizes": list(batch_sizes),
            "prompts": [r.prompt_token_ids for r in decode_prompts],
            "max_tokens": decode_max_tokens,
            "repeats": repeats,
        },
    }


def run_kvfleet(plan: dict[str, Any]) -> dict[str, Any]:
    llm = LLM(
        plan["model"],
        dtype=plan["dtype"],
        max_num_seqs=plan["max_num_seqs"],
        cpu_kv_cache_space=plan["cpu_kv_cache_space"],
        seed=plan["seed"],
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))

    return {
        "engine": "kvfleet",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **measure(generate, plan),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
