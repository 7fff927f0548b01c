"""Incremental detokenization and stop strings.

Decoding a growing token list one token at a time can split a multi-byte character (or a word piece that
changes how its neighbour renders), so text is only released once it is stable. Tokenizers backed by the
`tokenizers` library use its DecodeStream, one decoder step per token; others (and those whose text
Transformers cleans up after decoding) re-decode a short window of tokens around each new one, the trick of
Hugging Face's streamers.
"""

from __future__ import annotations

from typing import Protocol

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Tokens rendered before the new ones, so merges across the boundary render correctly.
_CONTEXT_TOKENS = 5


class _TextStream(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes: empty while a character or word piece is unfinished."""
        ...

    def flush(self) -> str:
        """The text of tokens still held back, unfinished characters rendered as U+FFFD."""
        ...


class _DecodeStreamText:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._rendered = context  # the last tokens whose text is out, as the context of a flush
        self._held: list[int] = []

    def step(self, token_id: int) -> str:
        self._held.append(token_id)
        chunk = self._stream.step(self._backend, token_id)
        if chunk is None:
            return ""
        self._rendered = (self._rendered + self._held)[-_CONTEXT_TOKENS:]
        self._held = []
        return chunk

    def flush(self) -> str:
        if not self._held:
            return ""
        decode = self._backend.decode
        held = decode(self._rendered, skip_special_tokens=self._skip_special_tokens)
        tail = decode(self._rendered + self._held, skip_special_tokens=self._skip_special_tokens)
        self._held = []
        return tail[len(held) :]


class _WindowText:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        tail = self._decode(self._token_ids[self._prefix_offset :])
        held = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return tail[len(held) :]


def _streams_exactly(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether DecodeStream renders what `tokenizer.decode` would: it needs the `tokenizers` backend, and it
    does not apply Transformers' clean-up of spaces before punctuation."""
    return hasattr(tokenizer, "backend_tokenizer") and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    )


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        *,
        skip_special_tokens: bool,
        include_stop_str_in_output: bool,
    ) -> None:
        # The prompt's last tokens are the context, so that the first generated token renders as it follows.
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        text_stream = _DecodeStreamText if _streams_exactly(tokenizer) else _WindowText
        self._text_stream: _TextStream = text_stream(tokenizer, context, skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self.text = ""
        self.stop_reason: str | None = None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is then cut before it)."""
        start = len(self.text)
        self.text += "".join(self._text_stream.step(token_id) for token_id in new_token_ids)
        if self._stop and len(self.text) > start:
            return self._check_stop(start)
        return None

    def _check_stop(self, new_text_start: int) -> str | None:
        longest = max(len(s) for s in self._stop)
        search_from = max(0, new_text_start - longest + 1)
        found: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stop_reason = stop
        return stop

    def finish(self) -> None:
        """Flush text held back while waiting for a character to complete."""
        if self.stop_reason is None:
            self.text += self._text_stream.flush()
