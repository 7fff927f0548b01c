"""The reasoning parsers against the tokenizer of a made Qwen3 model (whose vocabulary holds <think> and
</think>, as Qwen3's does): outputs assembled from real token ids are split as the tokenizer decodes the ids
on either side of the first </think> token (the oracle), whole and fed in pieces, with the text of a piece
lagging behind its ids as the engine's may."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime.models.make_model import corpus_text
from kvfleet.runtime.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser
from transformers import AutoTokenizer

WORDS = corpus_text().split()[:400]


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[..., Path]) -> object:
    return AutoTokenizer.from_pretrained(make_model("qwen3", "tiny"))


def _ids(tokenizer: object, rng: random.Random) -> list[int]:
    start = rng.randrange(len(WORDS) - 12)
    return tokenizer.encode(" ".join(WORDS[start : start + rng.randrange(1, 12)]), add_special_tokens=False)


def _output(tokenizer: object, rng: random.Random, *, opening_tag: bool, ends: int) -> list[int]:
    """Token ids of an output: words, with the opening tag first if asked, and `ends` end tags among them
    (some also spelled out in plain characters, which are not tags)."""
    start_id, end_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    ids = [start_id] if opening_tag else []
    for _ in range(ends):
        ids += _ids(tokenizer, rng) + tokenizer.encode(" <", add_special_tokens=False) + [end_id]
    return ids + _ids(tokenizer, rng)


def _oracle(tokenizer: object, ids: list[int]) -> tuple[str | None, str | None]:
    start_id, end_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    end = ids.index(end_id) if end_id in ids else len(ids)
    reasoning = tokenizer.decode([token for token in ids[:end] if token != start_id])
    content = tokenizer.decode(ids[end + 1 :])
    return reasoning or None, content or None


def _streamed(
    parser: ReasoningParser, tokenizer: object, ids: list[int], rng: random.Random, kwargs: dict | None
) -> tuple[list[str], list[str]]:
    """Every delta's (reasoning, content), fed in random pieces whose text lags behind their ids."""
    stream = parser.stream(kwargs)
    text_sent = 0
    pieces: list[tuple[str, str]] = []
    at = 0
    while at < len(ids):
        step = rng.randrange(1, 5)
        delta_ids, at = ids[at : at + step], min(at + step, len(ids))
        finished = at == len(ids)
        known = tokenizer.decode(ids[:at])
        cut = len(known) if finished else rng.randrange(text_sent, len(known) + 1)
        pieces.append(stream.feed(known[text_sent:cut], delta_ids, finished=finished))
        text_sent = cut
    reasoning = [piece for piece, _ in pieces if piece]
    content = [piece for _, piece in pieces if piece]
    first_content = next((i for i, (_, piece) in enumerate(pieces) if piece), len(pieces))
    assert not any(piece for piece, _ in pieces[first_content + 1 :]), "reasoning after the content began"
    return reasoning, content


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("opening_tag", [True, False])
def test_outputs_split_at_the_first_end_tag_whole_and_streamed(
    tokenizer: object, name: str, opening_tag: bool
) -> None:
    parser = reasoning_parser(name, tokenizer)
    rng = random.Random(f"{name}{opening_tag}")
    for ends in [0, 1, 1, 1, 2] * 4:
        ids = _output(tokenizer, rng, opening_tag=opening_tag, ends=ends)
        expected = _oracle(tokenizer, ids)
        whole = parser.extract_reasoning(tokenizer.decode(ids), ids, None)
        assert (whole.reasoning, whole.content) == expected
        assert "<think>" not in (whole.reasoning or "")
        assert "</think>" not in (whole.reasoning or "")
        reasoning, content = _streamed(parser, tokenizer, ids, rng, None)
        assert ("".join(reasoning) or None, "".join(content) or None) == expected


def test_qwen3_with_thinking_switched_off_is_all_content(tokenizer: object) -> None:
    parser = reasoning_parser("qwen3", tokenizer)
    rng = random.Random(0)
    off = {"enable_thinking": False}
    for _ in range(5):
        ids = _output(tokenizer, rng, opening_tag=False, ends=rng.randrange(2))
        text = tokenizer.decode(ids)
        whole = parser.extract_reasoning(text, ids, off)
        assert (whole.reasoning, whole.content) == (None, text)
        reasoning, content = _streamed(parser, tokenizer, ids, rng, off)
        assert (reasoning, "".join(content)) == ([], text)
    assert parser.opens_in_reasoning({"enable_thinking": True})
    assert reasoning_parser("deepseek_r1", tokenizer).opens_in_reasoning(off)


def test_a_tokenizer_without_the_tags_is_refused(tiny_llama: Path) -> None:
    llama = AutoTokenizer.from_pretrained(tiny_llama)
    for name in REASONING_PARSERS:
        with pytest.raises(ValueError, match="no token <think>"):
            reasoning_parser(name, llama)
    with pytest.raises(ValueError, match="granite"):
        reasoning_parser("granite", llama)
