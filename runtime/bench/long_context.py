"""One very long prompt through chunked prefill: peak memory and time by context length, and the greedy
tokens against Transformers at one of the lengths.

Each length runs in a process of its own, so that its peak RSS is its own. The engine's KV pool holds that
length's blocks and no more, so what the peak gains from one length to the next is the KV cache (linear in
the context) plus whatever a step needs beyond it, which the torch backend's KV tiles keep from growing
with the context. The prompt is random token ids; the output is greedy, of a fixed length.
"""

from __future__ import annotations

import multiprocessing
import random
import resource
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TOP_N = 5


@dataclass(frozen=True)
class LongContextSettings:
    context_lens: tuple[int, ...]  # prompt + output tokens, one run each
    output_len: int = 64
    parity_len: int | None = None  # the context length whose tokens are checked against Transformers
    seed: int = 0


@dataclass
class LongContextRun:
    context_len: int
    prompt_len: int
    chunk_tokens: int
    ttft_seconds: float  # the whole chunked prefill, up to the first token
    seconds: float  # prompt in, last token out
    loaded_rss_mib: float  # peak RSS once the engine and its KV pool are loaded
    peak_rss_mib: float
    kv_cache_mib: float
    # Against Transformers on the same prompt, for the parity length: a sentence saying where the tokens
    # agree up to, or None when not checked.
    parity: str | None


def run_long_context(
    model_dir: Path,
    settings: LongContextSettings,
    engine_options: dict[str, Any],
    log: Callable[[str], None],
) -> list[LongContextRun]:
    spawn = multiprocessing.get_context("spawn")
    runs = []
    for context_len in settings.context_lens:
        log(f"context {context_len} tokens ...")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            run = pool.submit(_measure, model_dir, settings, context_len, engine_options).result()
        log(
            f"  {run.seconds:.1f} s, peak RSS {run.peak_rss_mib:.0f} MiB"
            + (f"; {run.parity}" if run.parity else "")
        )
        runs.append(run)
    return runs


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _measure(
    model_dir: Path, settings: LongContextSettings, context_len: int, engine_options: dict[str, Any]
) -> LongContextRun:
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    block_size = engine_options["block_size"]
    options = {
        **engine_options,
        "max_model_len": context_len,
        "num_gpu_blocks_override": -(-context_len // block_size),
        "enable_prefix_caching": False,
    }
    llm = LLM(str(model_dir), **options)
    engine = llm.llm_engine
    loaded_rss = _peak_rss_mib()
    prompt_len = context_len - settings.output_len
    rng = random.Random(settings.seed)
    prompt = [rng.randrange(16, engine.vocab_size) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=settings.output_len, ignore_eos=True, logprobs=TOP_N)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    peak_rss = _peak_rss_mib()
    metrics = output.metrics
    if metrics is None or metrics.first_token_time is None or metrics.finished_time is None:
        raise RuntimeError(f"the {context_len}-token request finished without its times: {output}")
    completion = output.outputs[0]
    core = engine.engine_core
    kv_cache_mib = sum(cache.numel() * cache.element_size() for cache in engine.runner.kv_caches) / 2**20
    chunk_tokens = core.max_num_batched_tokens
    del llm, engine, core  # free the KV pool before Transformers loads
    parity = None
    if context_len == settings.parity_len:
        ours_top = [set(sorted(step, key=step.get, reverse=True)[:TOP_N]) for step in completion.logprobs]
        parity = _compare_with_transformers(
            model_dir, prompt, completion.token_ids, ours_top, options["dtype"]
        )
    return LongContextRun(
        context_len,
        prompt_len,
        chunk_tokens,
        ttft_seconds=metrics.first_token_time - metrics.arrival_time,
        seconds=metrics.finished_time - metrics.arrival_time,
        loaded_rss_mib=loaded_rss,
        peak_rss_mib=peak_rss,
        kv_cache_mib=kv_cache_mib,
        parity=parity,
    )


def _compare_with_transformers(
    model_dir: Path, prompt: list[int], ours: list[int], ours_top: list[set[int]], dtype: str
) -> str:
    """The criterion of vLLM's model tests: equal tokens, or at the first difference each side's token is in
    the other's top 5, after which the sequences are no longer comparable."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype), attn_implementation="sdpa"
    )
    with torch.inference_mode():
        generated = model.eval().generate(
            torch.tensor([prompt]),
            max_new_tokens=len(ours),
            min_new_tokens=len(ours),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    theirs = generated.sequences[0, len(prompt) :].tolist()
    for step, (our_token, their_token) in enumerate(zip(ours, theirs, strict=True)):
        if our_token == their_token:
            continue
        their_top = set(generated.logits[step][0].topk(TOP_N).indices.tolist())
        if our_token in their_top and their_token in ours_top[step]:
            return f"matches Transformers: {step} tokens equal, then both in each other's top-{TOP_N}"
        return f"DIFFERS from Transformers at token {step}: {our_token} vs {their_token}"
    return f"matches Transformers: all {len(ours)} tokens equal"


def format_report(runs: list[LongContextRun], machine: str) -> str:
    lines = [
        f"machine: {machine}; prefill in chunks of {runs[0].chunk_tokens} tokens\n",
        "| context (tokens) | prompt | output | TTFT (s) | total (s) | KV cache (MiB) | RSS loaded (MiB) "
        "| peak RSS (MiB) | peak - loaded (MiB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        growth = run.peak_rss_mib - run.loaded_rss_mib
        lines.append(
            f"| {run.context_len} | {run.prompt_len} | {run.context_len - run.prompt_len} | "
            f"{run.ttft_seconds:.1f} | {run.seconds:.1f} | {run.kv_cache_mib:.0f} | "
            f"{run.loaded_rss_mib:.0f} | {run.peak_rss_mib:.0f} | {growth:.0f} |"
        )
    lines += [f"\ncontext {run.context_len}: {run.parity}" for run in runs if run.parity]
    return "\n".join(lines)
