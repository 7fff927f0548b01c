"""The texts logprobs name tokens by, as vLLM names them.

A token's name is its text decoded alone, with two repairs that make a sequence's names join to its text:

- A SentencePiece tokenizer (a Metaspace pre-tokenizer, as Llama 2's and Mistral's) drops a token's leading
  space when it decodes it alone; the name keeps it, from the token's piece.
- A token decoded alone can end in U+FFFD: a byte token that holds the first bytes of a character (a CJK
  character or an emoji is often two to four tokens). Such a token is named by the text it completes after
  the tokens chosen before it in the sequence, and "" while its character is still incomplete; so each
  character is named once, by the token that ends it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

REPLACEMENT_CHARACTER = "\ufffd"
# The tokens before one that its character may have begun in: a UTF-8 character has 4 bytes at most.
_CONTEXT_TOKENS = 4


class TokenNames:
    """The names at each place of one sequence (an answer, or a prompt's scored tokens), in order."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._chosen: list[int] = []

    def next(self, chosen: int, others: Iterable[int] = ()) -> dict[int, str]:
        """The names of the token chosen at the next place and of the others scored there; then moves on."""
        names = {token_id: self._name(token_id) for token_id in (chosen, *others)}
        self._chosen = [*self._chosen, chosen][-_CONTEXT_TOKENS:]
        return names

    def _name(self, token_id: int) -> str:
        alone = self._alone(token_id)
        if not alone.endswith(REPLACEMENT_CHARACTER):
            return alone
        decode = self._tokenizer.decode
        # The fewest tokens before it that complete its character, if any do.
        for count in range(1, len(self._chosen) + 1):
            before = self._chosen[-count:]
            text = decode([*before, token_id])
            if text.endswith(REPLACEMENT_CHARACTER):
                continue
            # The tokens before it that hold earlier bytes of that character were named "": the character is
            # this token's. What comes before them is not.
            unfinished = 0
            while unfinished < count and decode([before[-1 - unfinished]]).endswith(REPLACEMENT_CHARACTER):
                unfinished += 1
            settled = decode(before[: count - unfinished]) if unfinished < count else ""
            # Where normalisation changes the settled part, the name is the text past what the two share.
            return text[_shared_length(settled, text) :]
        return ""

    def _alone(self, token_id: int) -> str:
        text = self._tokenizer.decode([token_id])
        marker = _space_marker(self._tokenizer)
        if marker is None:
            return text
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        dropped = (len(piece) - len(piece.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
        return " " * dropped + text


@lru_cache(maxsize=8)
def _space_marker(tokenizer: Any) -> str | None:
    """The character a Metaspace pre-tokenizer writes for a space (None without one): read once per
    tokenizer, from its whole definition."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pre_tokenizer = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    for step in [pre_tokenizer, *pre_tokenizer.get("pretokenizers", [])]:
        if step.get("type") == "Metaspace":
            return step.get("replacement", "▁")
    return None


def _shared_length(first: str, second: str) -> int:
    return next(
        (at for at, (one, other) in enumerate(zip(first, second, strict=False)) if one != other),
        min(len(first), len(second)),
    )
