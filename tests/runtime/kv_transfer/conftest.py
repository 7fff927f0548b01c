"""Fixtures of the disaggregated prefill and decode tests: a prefill and a decode engine, and Transformers'
greedy tokens as the oracle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM
from pd_engines import MAX_TOKENS, make_llm, shutdown
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def transformers_greedy(tiny_llama: Path) -> Callable[[list[list[int]]], list[list[int]]]:
    """Transformers' greedy tokens after each prompt, alone (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def run(prompts: list[list[int]]) -> list[list[int]]:
        results = []
        with torch.inference_mode():
            for prompt in prompts:
                out = model.generate(
                    input_ids=torch.tensor([prompt]),
                    max_new_tokens=MAX_TOKENS,
                    min_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                )
                results.append(out[0, len(prompt) :].tolist())
        return results

    return run


@pytest.fixture(scope="module")
def pd_pair(tiny_llama: Path) -> Iterator[tuple[LLM, LLM]]:
    """A prefill engine and a decode engine, with prefix caching and chunked prefill (the defaults)."""
    producer = make_llm(tiny_llama, "kv_producer")
    consumer = make_llm(tiny_llama, "kv_consumer")
    yield producer, consumer
    shutdown(producer, consumer)
