"""The first and mean poolings of a prompt computed in chunks over several steps: a prompt computed again
from its start (after preemption) is pooled from the new pass alone, and a chunk that does not follow the
last one kept is an error rather than a wrong embedding. (The poolings against Transformers, with chunked
prefill and prefix-cache hits, are in tests/runtime/engine/test_llm_vs_transformers.py.)"""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.worker.prompt_pooling import PooledPromptRows, PromptPooler

HIDDEN = 6


def _step(pooler: PromptPooler, pooling: str, first_position: int, states: torch.Tensor) -> None:
    """A step whose batch holds another request's 2 rows, then this request's `states`."""
    hidden = torch.cat([torch.randn(2, HIDDEN), states])
    pooler.keep("r", pooling, PooledPromptRows(2, first_position, len(states)), hidden)  # type: ignore[arg-type]


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_a_prompt_computed_again_is_pooled_from_its_new_pass(pooling: str) -> None:
    pooler = PromptPooler()
    first_pass = torch.randn(7, HIDDEN)
    _step(pooler, pooling, 0, first_pass[:3])
    _step(pooler, pooling, 3, first_pass[3:5])
    # Preempted, then computed again from the start in other chunks, with other values.
    second_pass = torch.randn(7, HIDDEN)
    _step(pooler, pooling, 0, second_pass[:4])
    _step(pooler, pooling, 4, second_pass[4:])
    pooled = pooler.pooled("r", pooling, second_pass[-1])  # type: ignore[arg-type]
    expected = second_pass.mean(dim=0) if pooling == "MEAN" else second_pass[0]
    torch.testing.assert_close(torch.tensor(pooled), expected)


def test_a_chunk_that_skips_positions_is_refused() -> None:
    pooler = PromptPooler()
    _step(pooler, "MEAN", 0, torch.randn(3, HIDDEN))
    with pytest.raises(RuntimeError, match="reach position 3, but the step feeds position 5"):
        _step(pooler, "MEAN", 5, torch.randn(2, HIDDEN))


def test_a_request_forgotten_before_its_last_chunk_leaves_nothing() -> None:
    pooler = PromptPooler()
    _step(pooler, "MEAN", 0, torch.randn(3, HIDDEN))
    pooler.forget({"r"})
    with pytest.raises(RuntimeError, match="feeds position 3"):
        _step(pooler, "MEAN", 3, torch.randn(2, HIDDEN))
