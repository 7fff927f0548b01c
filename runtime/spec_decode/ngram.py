"""Prompt lookup: when the context's last n tokens occurred before, propose what followed them then."""

from __future__ import annotations

import numpy as np
from kvfleet.runtime.request import Request
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Per request, at most its num_tokens draft tokens (maybe none)."""
        return [self._lookup(r.all_token_ids, n) for r, n in zip(requests, num_tokens, strict=True)]

    def _lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens tokens that followed the latest earlier occurrence of the longest suffix of
        token_ids (between prompt_lookup_min and prompt_lookup_max tokens long) found earlier in it."""
        length = len(token_ids)
        if num_tokens <= 0 or length <= self.prompt_lookup_min:
            return []
        context = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            # Windows starting before the suffix itself: every earlier place the n-gram could occur.
            windows = sliding_window_view(context[: length - 1], n)
            matches = np.flatnonzero((windows == context[length - n :]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return token_ids[start : start + num_tokens]
        return []
