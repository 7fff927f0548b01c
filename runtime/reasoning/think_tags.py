"""Reasoning that the model writes between `<think>` and `</think>`, each tag one token of its vocabulary.

The split is decided by token ids, not by text: the reasoning ends where the `</think>` token is generated
(text that merely spells the tag is reasoning like any other), and a tag's own text, which the tokenizer
decodes, is taken out of both parts. The engine may hand out a token's text later than its id (text held back
while it could begin a stop string), so the text of a tag whose token has come is looked for as it arrives,
and a tail that may begin it is held back until it does.

A whole answer is split by the same stream fed once, so a streamed answer's pieces join to the whole one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

START_TAG = "<think>"
END_TAG = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's reasoning and content; None for a part with no text."""

    reasoning: str | None
    content: str | None


class ReasoningParser(ABC):
    """A model family's reasoning format, bound to its tokenizer's tag token ids."""

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (START_TAG, END_TAG) if tag not in vocab]
        if missing:
            raise ValueError(
                f"the {type(self).__name__} reasoning parser reads {START_TAG} and {END_TAG} as tokens, and "
                f"the model's tokenizer has no token {missing[0]}"
            )
        self.start_token_id: int = vocab[START_TAG]
        self.end_token_id: int = vocab[END_TAG]

    @abstractmethod
    def opens_in_reasoning(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the model's answer, to a prompt rendered with these chat template variables, begins with
        reasoning."""

    def stream(self, template_kwargs: dict[str, Any] | None) -> ReasoningStream:
        """The split of one output, fed as it grows."""
        return ReasoningStream(self, self.opens_in_reasoning(template_kwargs))

    def extract_reasoning(
        self, text: str, token_ids: list[int], template_kwargs: dict[str, Any] | None
    ) -> ReasoningSplit:
        """The split of a whole output."""
        reasoning, content = self.stream(template_kwargs).feed(text, token_ids, finished=True)
        return ReasoningSplit(reasoning or None, content or None)


class ReasoningStream:
    """Splits one output delta by delta: `feed` returns each delta's reasoning and content text."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        self.in_reasoning = in_reasoning
        self.text = ""
        # Characters of `text` given out (as either part, or as a tag taken out).
        self.sent = 0
        # The tags whose tokens have come, in order, and whose text has not yet been found.
        self.tags_due: list[str] = []

    def feed(self, text: str, token_ids: list[int], *, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of this delta; "" for a part it has none of."""
        self.text += text
        if not self.in_reasoning:
            return "", self._take(len(self.text))
        self._note_tags(token_ids)
        reasoning = ""
        while self.tags_due:
            tag = self.tags_due[0]
            at = self.text.find(tag, self.sent)
            if at < 0:
                break
            reasoning += self._take(at)
            self.sent += len(tag)
            self.tags_due.pop(0)
            if tag == END_TAG:
                self.in_reasoning = False
                return reasoning, self._take(len(self.text))
        end = len(self.text)
        if self.tags_due and not finished:
            end -= _partial_tag_length(self.text, self.sent, self.tags_due[0])
        return reasoning + self._take(end), ""

    def _note_tags(self, token_ids: list[int]) -> None:
        """Tags among the reasoning's token ids: up to the first end tag, which ends it."""
        if END_TAG in self.tags_due:
            return
        for token_id in token_ids:
            if token_id == self.parser.start_token_id:
                self.tags_due.append(START_TAG)
            elif token_id == self.parser.end_token_id:
                self.tags_due.append(END_TAG)
                return

    def _take(self, end: int) -> str:
        taken = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return taken


def _partial_tag_length(text: str, start: int, tag: str) -> int:
    """The length of the longest tail of text[start:] that begins `tag`."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - length :]):
            return length
    return 0
