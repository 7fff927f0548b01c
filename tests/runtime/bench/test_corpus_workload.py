"""`bench serve --dataset-name corpus`: prompts are passages of the bundled corpus under the model's
tokenizer, of the asked lengths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvfleet.runtime.bench.serve_datasets import corpus_token_ids
from kvfleet.runtime.bench.workloads import corpus_requests
from kvfleet.runtime.models.make_model import corpus_text
from transformers import AutoTokenizer


def test_prompts_are_passages_of_the_corpus(make_model: Callable[..., Path]) -> None:
    folder = make_model("qwen2", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = corpus_requests(20, (30, 60), (8, 16), corpus_token_ids(tokenizer), seed=3)
    text = " ".join(corpus_text().split())
    for request in requests:
        assert 30 <= len(request.prompt_token_ids) <= 60
        assert 8 <= request.output_len <= 16
        # Interior words of the passage (its ends may be cut mid-word) appear in the corpus in this order.
        words = tokenizer.decode(request.prompt_token_ids).split()[1:-1]
        assert " ".join(words) in text
    assert len({tuple(r.prompt_token_ids) for r in requests}) == len(requests)
