"""Streamed text against the tokenizer's own decode of the whole sequence, token by token, on a byte-level BPE
tokenizer (Llama 3's kind) and a SentencePiece-style one with byte fallback (Llama 2's and Mistral's kind):
characters split over several tokens, special tokens kept or skipped, and stop strings. DecodeStream's text
is also checked against the window re-decoding it replaced, step by step."""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime.engine import detokenizer
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

TEXTS = [
    "plain words, then punctuation.",
    "héllo wörld 你好 🙂 done",
    "🙂🙂 emoji in a row, 日本語のテキスト",
]


def _sentencepiece_style() -> PreTrainedTokenizerBase:
    """A Metaspace tokenizer whose pieces are ASCII letters (with and without the word marker) and `é`; every
    other character falls back to its UTF-8 bytes, one token each."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    letters = string.ascii_lowercase + ",."
    for piece in ["▁", *letters, *("▁" + c for c in letters), "é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", c) for c in letters]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> PreTrainedTokenizerBase:
    if request.param == "byte-level":
        return AutoTokenizer.from_pretrained(make_model("llama", "tiny"))
    return _sentencepiece_style()


def _stream(
    tokenizer: PreTrainedTokenizerBase, prompt: list[int], generated: list[int], skip: bool, stop: list[str]
) -> tuple[list[str], IncrementalDetokenizer]:
    """The text after each token, and the detokenizer after `finish`."""
    detok = IncrementalDetokenizer(
        tokenizer, prompt, stop, skip_special_tokens=skip, include_stop_str_in_output=False
    )
    texts = []
    for token_id in generated:
        detok.update([token_id])
        texts.append(detok.text)
        if detok.stop_reason is not None:
            break
    detok.finish()
    return texts, detok


def _with_special_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The text's tokens with a special token after its first word and one at the end."""
    head, tail = text.split(" ", 1)
    encode = tokenizer.encode
    ids = encode(head, add_special_tokens=False), encode(" " + tail, add_special_tokens=False)
    return [*ids[0], tokenizer.eos_token_id, *ids[1], tokenizer.bos_token_id]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_decode_of_the_whole_sequence(tokenizer, text: str, skip: bool) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    generated = _with_special_tokens(tokenizer, text)
    texts, detok = _stream(tokenizer, prompt, generated, skip, [])
    whole = tokenizer.decode(prompt + generated, skip_special_tokens=skip)
    assert detok.text == whole[len(tokenizer.decode(prompt, skip_special_tokens=skip)) :]
    # Text only grows, and never shows half a character.
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert not any("\ufffd" in t for t in texts)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_stream_releases_the_same_text_as_window_decoding(
    tokenizer, monkeypatch: pytest.MonkeyPatch, text: str, skip: bool
) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    generated = _with_special_tokens(tokenizer, text)
    streamed, _ = _stream(tokenizer, prompt, generated, skip, [])
    monkeypatch.setattr(detokenizer, "_streams_exactly", lambda _tokenizer: False)
    windowed, _ = _stream(tokenizer, prompt, generated, skip, [])
    assert streamed == windowed


def test_a_stop_string_inside_a_multibyte_run_cuts_the_text(tokenizer) -> None:
    generated = tokenizer.encode("alpha 你好 beta 🙂 gamma", add_special_tokens=False)
    _, detok = _stream(tokenizer, [], generated, True, ["好 b"])
    assert detok.stop_reason == "好 b"
    assert detok.text == "alpha 你"


def test_an_unfinished_character_at_the_end_is_flushed_as_a_replacement(tokenizer) -> None:
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1, "the emoji must span several tokens for this case"
    _, detok = _stream(
        tokenizer, [], [*tokenizer.encode("ok", add_special_tokens=False), *emoji[:-1]], True, []
    )
    assert detok.text.startswith("ok") and detok.text.endswith("\ufffd")
