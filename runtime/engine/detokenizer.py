"""Incremental detokenization and stop strings.

Decoding a growing token list one token at a time can split a multi-byte character (or a word piece that
changes how its neighbour renders), so text is only released once the decoded tail is stable: the window
trick of Hugging Face's streamers and vLLM's detokenizer.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens re-decoded before the new ones, so merges across the boundary render correctly.
_CONTEXT_TOKENS = 5


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
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        # The prompt's last tokens seed the window so the first generated token renders in context.
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""
        self.stop_reason: str | None = None

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is then cut before it)."""
        start = len(self.text)
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._token_ids[self._prefix_offset :])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._token_ids)
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
        if self.stop_reason is not None:
            return
        tail = self._decode(self._token_ids[self._prefix_offset :])
        held = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(held):
            self.text += tail[len(held) :]
            self._prefix_offset = self._read_offset = len(self._token_ids)
