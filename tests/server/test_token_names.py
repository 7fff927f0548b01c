"""The names logprobs give tokens that hold part of a character, against the tokenizer's own decoding of the
whole sequence: each character is named once, by the token that ends it, so the names join to the text."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.runtime.serving.token_names import REPLACEMENT_CHARACTER, TokenNames
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

TEXTS = ["日本語のテキスト 😀 café", "Ünïcödé ✓ 🚀🚀 中文字符", "plain ascii"]


@pytest.mark.parametrize("text", TEXTS)
def test_names_join_to_the_text_at_every_whole_character(tiny_llama: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    names = TokenNames(tokenizer)
    joined = ""
    for count, token_id in enumerate(token_ids, start=1):
        joined += names.next(token_id)[token_id]
        decoded = tokenizer.decode(token_ids[:count])
        if not decoded.endswith(REPLACEMENT_CHARACTER):
            assert joined == decoded
    assert joined == text


def test_a_token_alone_that_ends_no_character_is_named_empty(tiny_llama: Path) -> None:
    """The bytes of 😀 are tokens of their own in this vocabulary: the first three name nothing, the last
    the whole character; an alternative at the last place is named as it would complete the same bytes."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    pieces = tokenizer("😀", add_special_tokens=False).input_ids
    assert len(pieces) > 1 and all(tokenizer.decode([piece]) == REPLACEMENT_CHARACTER for piece in pieces)
    names = TokenNames(tokenizer)
    assert [names.next(piece)[piece] for piece in pieces[:-1]] == [""] * (len(pieces) - 1)
    (grin,) = tokenizer("😁", add_special_tokens=False).input_ids[-1:]
    last = names.next(pieces[-1], [grin])
    assert last == {pieces[-1]: "😀", grin: "😁"}


def _sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer built as Llama 2's and Mistral's are: SentencePiece's BPE with byte fallback behind a
    Metaspace pre-tokenizer, whose decoder drops the space it puts before the text."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special)
    tokenizer.train_from_iterator(["hello world, a small corpus of words: café and façade"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_a_sentencepiece_token_keeps_the_space_it_begins_with() -> None:
    """Decoded alone, a piece like "▁hello" loses its space; named, it keeps it, and the names join to the
    text with the space the tokenizer put before it."""
    tokenizer = _sentencepiece_tokenizer()
    text = "hello 日本 world😀 café"
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = tokenizer.convert_ids_to_tokens(token_ids)
    assert pieces[0].startswith("▁") and "<0xE6>" in pieces
    assert tokenizer.decode(token_ids) == text
    names = TokenNames(tokenizer)
    named = [names.next(token_id)[token_id] for token_id in token_ids]
    assert "".join(named) == " " + text
    for token_id, piece, name in zip(token_ids, pieces, named, strict=True):
        if piece.startswith("▁") and piece != "▁":
            assert name == " " + tokenizer.decode([token_id]) == piece.replace("▁", " ")
