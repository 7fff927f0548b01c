"""The n-gram proposer's lookups, speculation backing off when the batch is large, and vLLM's shorthand
flags of the speculative config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.request import Request
from kvfleet.runtime.spec_decode.ngram import NgramProposer


def _propose(proposer: NgramProposer, tokens: list[int], num_tokens: int = 3) -> list[int]:
    return proposer.propose([Request("r", tokens, SamplingParams())], [num_tokens])[0]


def test_the_longest_suffix_found_earlier_decides() -> None:
    # The suffix [5, 6] occurs after 1 (followed by 7 8 9), the suffix [6] also after 3 (followed by 4).
    tokens = [1, 5, 6, 7, 8, 9, 3, 6, 4, 2, 5, 6]
    assert _propose(NgramProposer(1, 2), tokens) == [7, 8, 9]
    assert _propose(NgramProposer(1, 1), tokens) == [4, 2, 5]  # the latest occurrence of [6]


def test_no_match_within_the_window_proposes_nothing() -> None:
    tokens = [1, 2, 3, 9, 2, 3]
    assert _propose(NgramProposer(3, 4), tokens) == []
    assert _propose(NgramProposer(2, 4), tokens) == [9, 2, 3]


def test_proposals_stop_at_the_end_of_the_context_and_at_the_limit() -> None:
    assert _propose(NgramProposer(1, 1), [4, 5, 4], num_tokens=5) == [5, 4]
    assert _propose(NgramProposer(1, 1), [4, 5, 6, 7, 4], num_tokens=2) == [5, 6]


@pytest.mark.parametrize(("concurrent", "speculates"), [(1, True), (4, False)])
def test_speculation_backs_off_at_the_configured_batch_size(
    make_model: Callable[..., Path], concurrent: int, speculates: bool
) -> None:
    model = str(make_model("llama", "tiny"))
    config = {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": 2,
        "disable_by_batch_size": 2,
    }
    llm = LLM(
        model, dtype="float32", num_gpu_blocks_override=64, max_model_len=256, speculative_config=config
    )
    # Equal prompts and lengths: the requests run side by side from the first step to the last.
    llm.generate([[20, 21, 22]] * concurrent, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert (llm.llm_engine.engine_core.stats.spec_decode_num_draft_tokens > 0) == speculates


def test_vllms_shorthand_flags_make_the_speculative_config(make_model: Callable[..., Path]) -> None:
    """--spec-method, --spec-model and --spec-tokens, as vLLM merges them into --speculative-config; a key
    given both ways is refused by name."""
    model = str(make_model("llama", "tiny"))
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    spelled_out = EngineConfig(model=model, speculative_config=draft).speculative()
    shorthand = EngineConfig(model=model, spec_method="draft_model", spec_model=model, spec_tokens=2)
    assert shorthand.speculative() == spelled_out
    mixed = EngineConfig(
        model=model, speculative_config={"method": "draft_model", "model": model}, spec_tokens=2
    )
    assert mixed.speculative() == spelled_out
    # A copy (as the draft model's runner makes) does not merge them again.
    assert dataclasses.replace(shorthand, speculative_config=None).speculative() is None
    with pytest.raises(ValueError, match=r"spec_tokens and speculative_config\['num_speculative_tokens'\]"):
        EngineConfig(model=model, speculative_config=draft, spec_tokens=3)
