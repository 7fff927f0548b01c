"""Seeded synthetic workloads: random token prompts, as vLLM's benchmarks use, so no dataset is needed; or
passages of the English corpus bundled for the tokenizers, for models trained on it (speculative decoding
needs text that a draft model can predict)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    *,
    seed: int = 0,
    first_token_id: int = 16,
) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the inclusive ranges; token ids skip the special ones."""
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(first_token_id, vocab_size) for _ in range(rng.randint(*prompt_len))],
            rng.randint(*output_len),
        )
        for _ in range(num_requests)
    ]


def corpus_requests(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    corpus_token_ids: list[int],
    *,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts are passages of the corpus (its tokens under the model's tokenizer) at random places."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = min(rng.randint(*prompt_len), len(corpus_token_ids))
        start = rng.randrange(len(corpus_token_ids) - length + 1)
        requests.append(BenchRequest(corpus_token_ids[start : start + length], rng.randint(*output_len)))
    return requests


def shared_prefix_requests(
    num_requests: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: int,
    vocab_size: int,
    *,
    seed: int = 0,
    first_token_id: int = 16,
) -> list[BenchRequest]:
    """Every prompt starts with the same system prompt, then a request of its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(first_token_id, vocab_size) for _ in range(prefix_len)]
    return [
        BenchRequest(
            prefix + [rng.randrange(first_token_id, vocab_size) for _ in range(rng.randint(*suffix_len))],
            output_len,
        )
        for _ in range(num_requests)
    ]
