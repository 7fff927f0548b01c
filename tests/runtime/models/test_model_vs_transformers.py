"""Our Llama-family model, run through the ModelRunner over a paged KV cache in several steps (chunked
prefill, prefix-cache hits, decodes), gives the logits Hugging Face Transformers computes on the whole
sequence at once (float32, CPU)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from transformers import AutoModelForCausalLM

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3-moe")


def _transformers_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]


def _check_against_transformers(model_dir: Path, scheduler, requests: list[Request]) -> int:
    """Every logits row the runner computed equals Transformers' at that position; returns rows checked."""
    by_id = {r.request_id: r for r in requests}
    reference = {r.request_id: _transformers_logits(model_dir, r.all_token_ids) for r in requests}
    checked = 0
    for record in scheduler.records:
        if record.logits is None:
            continue
        for row, (request_id, position) in enumerate(record.logit_rows):
            expected = reference[request_id][position]
            torch.testing.assert_close(record.logits[row], expected, atol=2e-4, rtol=1e-4)
            assert by_id[request_id].all_token_ids[position + 1] == int(record.logits[row].argmax())
            checked += 1
    return checked


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_transformers(
    arch: str, backend: str, tiny_model: Callable[[str], Path], runner_for, hand_scheduler
) -> None:
    model_dir = tiny_model(arch)
    runner = runner_for(model_dir, attention_backend=backend)
    rng = random.Random(7)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    requests = [
        Request(f"r{n}", [rng.randrange(8, runner.vocab_size) for _ in range(n)], greedy)
        for n in (1, 6, 19, 37)
    ]
    scheduler = hand_scheduler(runner, chunk_size=8, seed=3)
    for request in requests:
        scheduler.add(request)
    scheduler.run(requests, num_output_tokens=6)
    # Prefill chunks and decodes shared steps: the 37-token prompt was still prefilling while others decoded.
    mixed = [
        r
        for r in scheduler.records
        if max(r.output.num_scheduled_tokens) > 1 and min(r.output.num_scheduled_tokens) == 1
    ]
    assert mixed
    assert _check_against_transformers(model_dir, scheduler, requests) == 4 * 6


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen3-moe"])
def test_prefix_cache_hit_matches_transformers(
    arch: str, tiny_model: Callable[[str], Path], runner_for, hand_scheduler
) -> None:
    model_dir = tiny_model(arch)
    runner = runner_for(model_dir)
    rng = random.Random(11)
    shared = [rng.randrange(8, runner.vocab_size) for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = Request("first", [*shared, 5, 9, 13], greedy)
    second = Request("second", [*shared, 21, 22, 23, 24, 25, 26], greedy)
    scheduler = hand_scheduler(runner, chunk_size=5, seed=5)
    scheduler.add(first)
    scheduler.run([first], num_output_tokens=1)
    # The second request starts on the first's physical blocks for the 12 shared tokens (3 blocks of 4).
    scheduler.add(second, shared_prefix_from=first, shared_tokens=12)
    scheduler.run([first, second], num_output_tokens=4)
    first_steps = [r for r in scheduler.records if second in r.output.requests]
    assert first_steps[0].output.num_computed_tokens[first_steps[0].output.requests.index(second)] == 12
    assert _check_against_transformers(model_dir, scheduler, [first, second]) == 8
