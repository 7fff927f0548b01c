"""Offline sleep mode (vLLM's LLM.sleep and LLM.wake_up): what each level frees, and greedy answers after
the wake-up equal to those before and to Transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.errors import EngineSleepingError, InvalidRequestError
from test_async_llm import PROMPT, greedy_tokens

MAX_TOKENS = 8
PROMPTS = [PROMPT * 8, PROMPT * 8 + [9, 10]]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(
        str(tiny_llama),
        dtype="float32",
        enable_sleep_mode=True,
        num_gpu_blocks_override=64,
        block_size=8,
        max_model_len=256,
        kv_offloading_size=0.001,
    )


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]


def _prefix_cache_hits(llm: LLM, prompt: list[int]) -> int:
    """The prefix-cache hits of running the prompt once more."""
    before = llm.llm_engine.stats.prefix_cache_hits
    _greedy(llm, [prompt])
    return llm.llm_engine.stats.prefix_cache_hits - before


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_the_wake_up_answers_alike(
    llm: LLM, tiny_llama: Path, level: int
) -> None:
    before = _greedy(llm, PROMPTS)
    assert before[0] == greedy_tokens(tiny_llama, PROMPTS[0], MAX_TOKENS)
    assert _prefix_cache_hits(llm, PROMPTS[0]) > 0
    runner = llm.llm_engine.runner
    llm.sleep(level)
    assert llm.llm_engine.is_sleeping()
    assert runner.kv_caches == [] and runner.host_kv_caches == []
    assert (runner.model is None) == (level == 2), "level 1 keeps the weights, level 2 drops them"
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, use_tqdm=False)

    llm.wake_up(["weights"])
    assert llm.llm_engine.is_sleeping(), "the KV cache is still asleep"
    assert runner.model is not None and runner.kv_caches == []
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    assert _prefix_cache_hits(llm, PROMPTS[0]) == 0, "the sleep forgot the prefix cache, whose blocks went"
    assert _greedy(llm, PROMPTS) == before


def test_what_sleep_refuses(llm: LLM, tiny_llama: Path) -> None:
    with pytest.raises(InvalidRequestError, match="level"):
        llm.sleep(3)
    with pytest.raises(InvalidRequestError, match="tags"):
        llm.wake_up(["everything"])
    assert not llm.llm_engine.is_sleeping()
    without = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=16, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="enable_sleep_mode"):
        without.sleep(1)
    # What a KV connector or a draft model holds would stay: refused when the engine is configured.
    draft = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2}
    connector = {"kv_connector": "TcpConnector", "kv_role": "kv_both"}
    for options in ({"kv_transfer_config": connector}, {"speculative_config": draft}):
        EngineConfig(model=str(tiny_llama), **options)
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            EngineConfig(model=str(tiny_llama), enable_sleep_mode=True, **options)
