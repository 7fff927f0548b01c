"""Applies the grammars and token rules (logit_bias, allowed_token_ids, bad_words) of a step's constrained
rows to their logits, before sampling.

One token bitmask (a bit per vocabulary entry) is filled for the rows that mask tokens and applied in one
call; a batch without constrained rows costs one pass over its requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import xgrammar
from kvfleet.runtime.request import Request
from kvfleet.runtime.structured_outputs.bitmasks import clear_bits


class GrammarMasks:
    def __init__(self) -> None:
        # Reused from step to step, grown when a batch is larger.
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        # Steps that had constrained rows, and the time spent masking them.
        self.num_steps = 0
        self.seconds = 0.0

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """logits: [len(requests), vocab], modified in place: tokens a row's grammar, allowed_token_ids or
        bad_words forbid get -inf, then logit_bias is added."""
        rows = [row for row, r in enumerate(requests) if r.grammar is not None or r.token_rules is not None]
        if not rows:
            return
        start = time.perf_counter()
        masked = []
        bitmask = self._bitmask_for(len(requests), logits.shape[1])
        for row in rows:
            request = requests[row]
            grammar, rules = request.grammar, request.token_rules
            if grammar is not None:
                grammar.matcher.fill_next_token_bitmask(bitmask, row)
                bitmask[row] &= grammar.token_filter
            elif rules is not None and rules.masks:
                bitmask[row] = -1  # every bit set: all allowed
            else:
                continue
            if rules is not None:
                if rules.allowed is not None:
                    bitmask[row] &= rules.allowed
                clear_bits(bitmask[row], rules.banned(request.output_token_ids))
            masked.append(row)
        if masked:
            xgrammar.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), indices=masked
            )
        for row in rows:
            rules = requests[row].token_rules
            if rules is not None and rules.bias_token_ids is not None and rules.bias_values is not None:
                ids = rules.bias_token_ids.to(logits.device)
                logits[row].index_add_(0, ids, rules.bias_values.to(logits.device, logits.dtype))
        self.num_steps += 1
        self.seconds += time.perf_counter() - start

    def _bitmask_for(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        width = xgrammar.get_bitmask_shape(1, vocab_size)[1]
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            self._bitmask = xgrammar.allocate_token_bitmask(
                max(num_rows, 2 * self._bitmask.shape[0]), vocab_size
            )
        return self._bitmask[:num_rows]
