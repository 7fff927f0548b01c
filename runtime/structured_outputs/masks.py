"""Applies the grammars of a step's constrained rows to their logits, before sampling.

One token bitmask (a bit per vocabulary entry) is filled for the rows that have a grammar and applied in one
call; a batch without constrained rows costs one pass over its requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import xgrammar
from kvfleet.runtime.request import Request


class GrammarMasks:
    def __init__(self) -> None:
        # Reused from step to step, grown when a batch is larger.
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        # Steps that had constrained rows, and the time spent masking them.
        self.num_steps = 0
        self.seconds = 0.0

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """logits: [len(requests), vocab], modified in place: tokens a row's grammar forbids get -inf."""
        rows = [row for row, request in enumerate(requests) if request.grammar is not None]
        if not rows:
            return
        start = time.perf_counter()
        bitmask = self._bitmask_for(len(requests), logits.shape[1])
        for row in rows:
            grammar = requests[row].grammar
            assert grammar is not None
            grammar.matcher.fill_next_token_bitmask(bitmask, row)
            bitmask[row] &= grammar.token_filter
        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), indices=rows
        )
        self.num_steps += 1
        self.seconds += time.perf_counter() - start

    def _bitmask_for(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        width = xgrammar.get_bitmask_shape(1, vocab_size)[1]
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            self._bitmask = xgrammar.allocate_token_bitmask(
                max(num_rows, 2 * self._bitmask.shape[0]), vocab_size
            )
        return self._bitmask[:num_rows]
