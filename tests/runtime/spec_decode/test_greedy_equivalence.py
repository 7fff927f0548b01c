"""Greedy outputs with speculative decoding are token-identical to greedy outputs without it.

Every architecture, both methods, in mixed batches: prompts of many lengths under a small token budget (so
prefill chunks share steps with verifying requests) and a KV cache too small for all of them at once (so
requests are preempted and recomputed). The KV pool must be whole again afterwards, however many draft
tokens were rejected.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams, StructuredOutputsParams

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
NUM_KV_BLOCKS = 20
BLOCK_SIZE = 16
ENGINE_OPTIONS = {
    "dtype": "float32",
    "num_gpu_blocks_override": NUM_KV_BLOCKS,
    "block_size": BLOCK_SIZE,
    "max_model_len": 160,
    "max_num_batched_tokens": 48,
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Copy-heavy prompts (a passage repeated, as when a text is quoted or edited) beside plain ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(10):
        passage = [rng.randrange(16, 500) for _ in range(rng.choice([3, 8, 15]))]
        prompts.append(passage * rng.choice([2, 4]) if i % 2 else passage + passage[:2])
    return prompts


def _generate(model: Path, prompts: list[list[int]], **options: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), **ENGINE_OPTIONS, **options)  # type: ignore[arg-type]
    outputs = llm.generate(prompts, PARAMS)
    return [list(output.outputs[0].token_ids) for output in outputs], llm


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> tuple[str, list, list]:
    arch = request.param
    prompts = _prompts(len(arch))
    reference, llm = _generate(make_model(arch, "tiny"), prompts)
    assert llm.llm_engine.engine_core.scheduler.num_preempted_total > 0, "the batch must preempt"
    return arch, prompts, reference


def _check(llm: LLM, outputs: list[list[int]], reference: list[list[int]]) -> dict[str, int]:
    core = llm.llm_engine.engine_core
    assert outputs == reference
    stats = core.stats
    assert core.scheduler.num_preempted_total > 0
    assert stats.spec_decode_num_draft_tokens > 0
    assert core.scheduler.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS
    return {
        "drafts": stats.spec_decode_num_draft_tokens,
        "accepted": stats.spec_decode_num_accepted_tokens,
    }


def test_ngram(arch_case: tuple[str, list, list], make_model: Callable[..., Path]) -> None:
    arch, prompts, reference = arch_case
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    outputs, llm = _generate(make_model(arch, "tiny"), prompts, speculative_config=config)
    counts = _check(llm, outputs, reference)
    # Some drafts are accepted and some rejected: both paths ran.
    assert 0 < counts["accepted"] < counts["drafts"]


def test_draft_model_that_always_agrees(
    arch_case: tuple[str, list, list], make_model: Callable[..., Path]
) -> None:
    arch, prompts, reference = arch_case
    target = make_model(arch, "tiny")
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    outputs, llm = _generate(target, prompts, speculative_config=config)
    counts = _check(llm, outputs, reference)
    assert counts["accepted"] == counts["drafts"]


def test_draft_model_that_disagrees(
    arch_case: tuple[str, list, list], make_model: Callable[..., Path]
) -> None:
    arch, prompts, reference = arch_case
    config = {
        "method": "draft_model",
        "model": str(make_model(arch, "tiny", seed=1)),
        "num_speculative_tokens": 2,
    }
    outputs, llm = _generate(make_model(arch, "tiny"), prompts, speculative_config=config)
    counts = _check(llm, outputs, reference)
    assert counts["accepted"] < counts["drafts"]


def test_structured_outputs_speculate_within_their_grammar(make_model: Callable[..., Path]) -> None:
    model = make_model("llama", "tiny")
    pattern = "(ab|cd|e){4,40}"
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    prompts = [[30 + i, 31, 32] for i in range(4)]

    def run(**options: object) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(model), dtype="float32", num_gpu_blocks_override=64, max_model_len=256, **options)  # type: ignore[arg-type]
        outputs = llm.generate(prompts, params)
        assert all(re.fullmatch(pattern, output.outputs[0].text) for output in outputs)
        return [list(output.outputs[0].token_ids) for output in outputs], llm

    reference, _ = run()
    # Constrained outputs repeat a few tokens, which prompt lookup proposes; the grammar cuts the drafts
    # where it forbids them and masks each verified position after the drafts before it.
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outputs, llm = run(speculative_config=config)
    assert outputs == reference
    stats = llm.llm_engine.engine_core.stats
    assert stats.spec_decode_num_accepted_tokens > 0
