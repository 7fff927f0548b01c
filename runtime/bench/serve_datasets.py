"""The prompts of `kvfleet bench serve`: vLLM's `random` and `sharegpt` datasets, and kvfleet's `corpus`.

`random` prompts are token ids drawn uniformly from the vocabulary above its special ids (no tokenizer
needed), after an optional prefix that every prompt shares; their lengths follow vLLM's --random-range-ratio.
`sharegpt` reads a ShareGPT-shaped JSON file offline: each conversation's first turn is a prompt and its
second the answer whose token count is the output length, pruned and oversampled as vLLM does.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from kvfleet.runtime.bench.workloads import corpus_requests, random_requests

# vLLM's pruning of ShareGPT conversations (token counts).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class DatasetPrompt:
    prompt_token_ids: list[int]
    output_len: int
    # Sent as text where set (a dataset of text), else as the token ids.
    text: str | None = None


def length_range(mean: int, ratio: float, minimum: int) -> tuple[int, int]:
    """vLLM's inclusive range of lengths around a mean: [floor(mean * (1 - r)), ceil(mean * (1 + r))]."""
    return max(minimum, math.floor(mean * (1 - ratio))), max(minimum, math.ceil(mean * (1 + ratio)))


def parse_range_ratio(text: str) -> tuple[float, float]:
    """`0.3` for input and output lengths alike, or `{"input": 0.3, "output": 0.5}`: the (input, output)
    ratios."""
    try:
        ratios: Any = float(text)
    except ValueError:
        try:
            ratios = json.loads(text)
        except json.JSONDecodeError:
            ratios = None
    if isinstance(ratios, float):
        ratios = {"input": ratios, "output": ratios}
    if not isinstance(ratios, dict) or set(ratios) != {"input", "output"}:
        raise click.BadParameter(
            'expected a number or {"input": R, "output": R}', param_hint="--random-range-ratio"
        )
    pair = float(ratios["input"]), float(ratios["output"])
    if not all(0 <= r < 1 for r in pair):
        raise click.BadParameter("each ratio must be in [0, 1)", param_hint="--random-range-ratio")
    return pair


def random_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: tuple[float, float],
    prefix_len: int,
    vocab_size: int,
    seed: int,
) -> list[DatasetPrompt]:
    """prefix_len tokens shared by every prompt, then its own tokens of a length in the input range."""
    input_range = length_range(input_len, range_ratio[0], 0)
    if prefix_len + input_range[0] < 1:
        raise click.BadParameter(
            "prompts could be empty: raise it, --random-prefix-len, or lower the input range ratio",
            param_hint="--random-input-len",
        )
    (prefix,) = random_requests(1, (prefix_len, prefix_len), (1, 1), vocab_size, seed=seed + 3)
    own = random_requests(
        num_prompts, input_range, length_range(output_len, range_ratio[1], 1), vocab_size, seed=seed
    )
    return [DatasetPrompt(prefix.prompt_token_ids + r.prompt_token_ids, r.output_len) for r in own]


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """The corpus `kvfleet make-model` trains on, under the model's tokenizer."""
    from kvfleet.runtime.models.make_model import corpus_text

    return tokenizer.encode(corpus_text(), add_special_tokens=False)


def corpus_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: tuple[float, float],
    tokenizer: Any,
    seed: int,
) -> list[DatasetPrompt]:
    """Passages of the corpus at random places, of lengths as `random`'s."""
    corpus = corpus_token_ids(tokenizer)
    input_range = length_range(input_len, range_ratio[0], 1)
    output_range = length_range(output_len, range_ratio[1], 1)
    return [
        DatasetPrompt(r.prompt_token_ids, r.output_len)
        for r in corpus_requests(num_prompts, input_range, output_range, corpus, seed=seed)
    ]


def sharegpt_prompts(
    path: Path, num_prompts: int, tokenizer: Any, output_len: int | None, seed: int
) -> list[DatasetPrompt]:
    """The first num_prompts conversations kept, in a seeded shuffle; too few are repeated at random."""
    conversations = [
        entry["conversations"]
        for entry in json.loads(path.read_text(encoding="utf-8"))
        if len(entry.get("conversations", ())) >= 2
    ]
    random.Random(seed).shuffle(conversations)
    prompts: list[DatasetPrompt] = []
    for turns in conversations:
        if len(prompts) == num_prompts:
            break
        prompt, answer = turns[0]["value"], turns[1]["value"]
        prompt_ids = tokenizer(prompt).input_ids
        wanted = len(tokenizer(answer).input_ids) if output_len is None else output_len
        if _kept(len(prompt_ids), wanted, check_output=output_len is None):
            prompts.append(DatasetPrompt(prompt_ids, wanted, prompt))
    if not prompts:
        raise click.UsageError(
            f"{path} has no conversation of usable length (prompt and answer of 4+ tokens)"
        )
    rng = random.Random(seed)
    return prompts + [rng.choice(prompts) for _ in range(num_prompts - len(prompts))]


def _kept(prompt_len: int, output_len: int, check_output: bool) -> bool:
    return (
        SHAREGPT_MIN_LEN <= prompt_len <= SHAREGPT_MAX_PROMPT_LEN
        and (output_len >= SHAREGPT_MIN_LEN or not check_output)
        and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN
    )
