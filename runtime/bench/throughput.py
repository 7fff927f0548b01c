"""Offline throughput: kvfleet against Hugging Face `generate` with static batches, on one workload.

Tokens/s counts the output tokens each request asked for, so padding and the tokens a static batch
generates past a request's own length are cost, not output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvfleet.runtime.bench.workloads import BenchRequest, random_requests, shared_prefix_requests
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class PrefixResult:
    prefix_caching: bool
    seconds: float
    prefill_tokens_computed: int
    hit_rate: float


@dataclass
class ThroughputReport:
    kvfleet: ThroughputResult
    transformers: list[ThroughputResult]
    prefix_sharing: list[PrefixResult]
    # Workloads like the main one share no prefix: what prefix caching costs when it (almost) never hits.
    caching_on: ThroughputResult
    caching_off: ThroughputResult
    caching_hit_rate: float


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_kvfleet(llm: LLM, requests: list[BenchRequest], name: str = "kvfleet") -> ThroughputResult:
    prompts = [r.prompt_token_ids for r in requests]
    params = [_params(r.output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r.output_len for r in requests)
    if produced != expected:
        raise RuntimeError(f"kvfleet produced {produced} tokens, the workload asked for {expected}")
    return ThroughputResult(name, seconds, produced)


def run_transformers(model_path: str, requests: list[BenchRequest], batch_size: int) -> ThroughputResult:
    """Static batches in arrival order, left-padded, each run until its longest request is done."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            n = len(request.prompt_token_ids)
            input_ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - n :] = 1
        new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
    seconds = time.perf_counter() - start
    return ThroughputResult(f"transformers batch {batch_size}", seconds, sum(r.output_len for r in requests))


def run_prefix_sharing(
    model_path: str, vocab_size: int, engine_options: dict, *, seed: int
) -> list[PrefixResult]:
    requests = shared_prefix_requests(64, 192, (16, 64), 32, vocab_size, seed=seed)
    results = []
    for caching in (True, False):
        llm = LLM(model_path, **{**engine_options, "enable_prefix_caching": caching})
        stats_before = llm.llm_engine.stats
        computed_before = stats_before.num_prefill_tokens_computed
        run = run_kvfleet(llm, requests)
        stats = llm.llm_engine.stats
        queries = stats.prefix_cache_queries
        results.append(
            PrefixResult(
                caching,
                run.seconds,
                stats.num_prefill_tokens_computed - computed_before,
                stats.prefix_cache_hits / queries if queries else 0.0,
            )
        )
    return results


def run_caching_cost(
    model_path: str, workloads: list[list[BenchRequest]], engine_options: dict
) -> tuple[ThroughputResult, ThroughputResult, float]:
    """Prefix caching on and off, interleaved so that load drifts hit both, one fresh workload per round
    (a repeated one would hit the blocks the last round cached). Returns the fastest run of each and the
    hit rate with caching on."""
    engines = {
        caching: LLM(model_path, **{**engine_options, "enable_prefix_caching": caching})
        for caching in (True, False)
    }
    fastest: dict[bool, ThroughputResult] = {}
    for requests in workloads:
        for caching, llm in engines.items():
            run = run_kvfleet(llm, requests, f"kvfleet, prefix caching {'on' if caching else 'off'}")
            if caching not in fastest or run.seconds < fastest[caching].seconds:
                fastest[caching] = run
    stats = engines[True].llm_engine.stats
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    return fastest[True], fastest[False], hit_rate


def run_all(
    model_path: str,
    *,
    num_requests: int,
    batch_sizes: list[int],
    engine_options: dict,
    seed: int,
    log: Callable[[str], None],
    caching_rounds: int = 2,
) -> ThroughputReport:
    llm = LLM(model_path, **engine_options)
    vocab_size = llm.llm_engine.vocab_size

    def workload(round_seed: int) -> list[BenchRequest]:
        return random_requests(num_requests, (16, 256), (16, 128), vocab_size, seed=round_seed)

    requests = workload(seed)
    log(f"warming up kvfleet ({llm.llm_engine.runner.device}, {torch.get_num_threads()} threads)")
    run_kvfleet(llm, requests[:8])
    results: list[ThroughputResult] = []

    def record(result: ThroughputResult) -> None:
        results.append(result)
        log(f"{result.name}: {result.tokens_per_second:.1f} output tokens/s ({result.seconds:.1f} s)")

    log("running kvfleet")
    record(run_kvfleet(llm, requests))
    del llm
    for batch_size in batch_sizes:
        log(f"running transformers generate, batch {batch_size}")
        record(run_transformers(model_path, requests, batch_size))
    log("running the shared-prefix workload with prefix caching on and off")
    prefix = run_prefix_sharing(model_path, vocab_size, engine_options, seed=seed)
    log(f"running workloads like the main one with prefix caching on and off, {caching_rounds} rounds")
    workloads = [workload(seed + 1 + round_index) for round_index in range(caching_rounds)]
    caching_on, caching_off, hit_rate = run_caching_cost(model_path, workloads, engine_options)
    kvfleet, *transformers = results
    return ThroughputReport(kvfleet, transformers, prefix, caching_on, caching_off, hit_rate)
