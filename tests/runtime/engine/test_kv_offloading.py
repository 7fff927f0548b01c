"""The host-memory KV tier (kv_offloading_size) under a workload that preempts often: short prompts, long
answers and a device cache of 12 blocks of 8 tokens for 16 requests, so that preempted requests have much
KV to recompute. The tokens are compared with a run without the tier (itself checked against Transformers
under preemption in test_llm_vs_transformers)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams

OPTIONS = {"dtype": "float32", "num_gpu_blocks_override": 12, "block_size": 8, "max_model_len": 96}
OPTIONS["max_num_batched_tokens"] = 64


def _run(model_dir: Path, kv_offloading_size: float | None) -> tuple[list[list[int]], object]:
    rng = random.Random(5)
    prompts = [[rng.randrange(16, 1000) for _ in range(rng.randint(8, 16))] for _ in range(16)]
    llm = LLM(str(model_dir), kv_offloading_size=kv_offloading_size, **OPTIONS)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs], llm.llm_engine.stats


@pytest.fixture(scope="module")
def without_tier(make_model: Callable[..., Path]) -> tuple[list[list[int]], object]:
    return _run(make_model("llama", "tiny"), None)


def test_preempted_requests_resume_from_the_host_tier(make_model, without_tier) -> None:
    tokens, stats = _run(make_model("llama", "tiny"), 0.01)
    reference_tokens, reference_stats = without_tier
    assert reference_stats.num_preempted_total > 10 and stats.num_preempted_total > 10
    assert tokens == reference_tokens
    assert stats.kv_offload_resumed_from_host == stats.num_preempted_total
    assert stats.kv_offload_resumed_by_recompute == 0
    # Every block saved for a preempted request came back (the others are evicted prefix blocks).
    saved = stats.kv_offload_blocks_offloaded - stats.kv_offload_prefix_blocks_spilled
    assert stats.kv_offload_blocks_reloaded - stats.kv_offload_prefix_blocks_loaded == saved > 0
    # Only the prompts are computed: nothing preempted is computed twice.
    assert stats.num_prefill_tokens_computed <= 0.5 * reference_stats.num_prefill_tokens_computed


def test_a_full_tier_drops_its_oldest_saves_which_are_recomputed(make_model, without_tier) -> None:
    # 20 KiB: about ten blocks of the tiny model, far fewer than the preempted requests hold.
    tokens, stats = _run(make_model("llama", "tiny"), 20 / 2**20)
    assert tokens == without_tier[0]
    assert stats.kv_offload_resumed_from_host > 0 and stats.kv_offload_resumed_by_recompute > 0
    saved = stats.kv_offload_blocks_offloaded - stats.kv_offload_prefix_blocks_spilled
    assert stats.kv_offload_blocks_reloaded - stats.kv_offload_prefix_blocks_loaded < saved


def _conversations(model_dir: Path, kv_offloading_size: float | None) -> tuple[list[list[int]], object]:
    """Eight conversations of three turns, each request carrying its whole history: together the histories
    need several times the device cache, so each turn finds its history evicted from the device."""
    rng = random.Random(7)
    histories = [[rng.randrange(16, 1000) for _ in range(40)] for _ in range(8)]
    llm = LLM(str(model_dir), kv_offloading_size=kv_offloading_size, **OPTIONS)
    answers = []
    for _ in range(3):
        outputs = llm.generate(histories, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for history, output in zip(histories, outputs, strict=True):
            answers.append(output.outputs[0].token_ids)
            history += [*output.outputs[0].token_ids, *(rng.randrange(16, 1000) for _ in range(4))]
    return answers, llm.llm_engine.stats


def test_evicted_history_is_loaded_back_from_the_host_tier(make_model) -> None:
    model_dir = make_model("llama", "tiny")
    reference_tokens, reference_stats = _conversations(model_dir, None)
    tokens, stats = _conversations(model_dir, 0.01)
    assert tokens == reference_tokens
    assert stats.kv_offload_prefix_blocks_spilled > 0 and stats.kv_offload_prefix_blocks_loaded > 0
    # Turns 2 and 3 compute only what is new since the last turn; without the tier, most of each history.
    assert stats.num_prefill_tokens_computed <= 0.6 * reference_stats.num_prefill_tokens_computed


def test_a_tier_larger_than_the_host_memory_is_refused(make_model) -> None:
    with pytest.raises(ValueError, match="more than the host's available memory"):
        LLM(str(make_model("llama", "tiny")), kv_offloading_size=1 << 20, **OPTIONS)
