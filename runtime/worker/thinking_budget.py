"""vLLM's `thinking_token_budget`: a request's reasoning is cut once it has that many tokens, by forcing the
tokens that end reasoning (the reasoning end string as the tokenizer encodes it), one a step.

Where a request stands is read from its tokens, the prompt's and then the output's: it reasons from the last
occurrence of the start tokens that no end follows, and its count is the tokens since then (those of the
prompt after a start the chat template wrote too). Once the count reaches the budget, the next token is the
first of the forced end, then the next, until all are written. A reasoning ends with the forced end's tokens
or with the model's own end (the reasoning parser's tag, where the forced end is other text): a model that
ends its reasoning itself within the budget is not touched, and a later start opens a new budget. Being a
function of the tokens, this holds alike for a draft position of speculative decoding (its drafts counted as
output) and for a request resumed after preemption; each request's scan goes on where its last one stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch


class _Tokens(Protocol):
    """A request, or a draft position of one, as far as its tokens go."""

    request_id: str
    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass(frozen=True)
class _Scan:
    """What the first `scanned` tokens of a request hold: where its last start and end sequences end."""

    scanned: int = 0
    after_start: int | None = None
    after_end: int | None = None


class ThinkingBudgets:
    """The reasoning's start and end token ids, and each budgeted request's scan of its tokens."""

    def __init__(self, start_ids: list[int], end_ids: list[int], natural_end_ids: list[int]) -> None:
        """`end_ids`: what a spent budget writes; `natural_end_ids`: how the model ends a reasoning itself."""
        if not start_ids or not end_ids or not natural_end_ids:
            raise ValueError("the reasoning start and end strings must each encode to at least one token")
        self.start_ids, self.end_ids = start_ids, end_ids
        self._ends = (end_ids, natural_end_ids)
        self._scans: dict[str, _Scan] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._scans.pop(request_id, None)

    def force(self, logits: torch.Tensor, rows: Sequence[_Tokens], budgets: Sequence[int | None]) -> None:
        """Leave each row whose budget has run out only its forced token (logits [rows, vocab], in place).
        A request's first row is its own (its scan is kept); the rows after it of the same request are draft
        positions, which have its tokens and those drafted before them."""
        own_rows: set[str] = set()
        for row, (tokens, budget) in enumerate(zip(rows, budgets, strict=True)):
            if budget is None:
                continue
            own = tokens.request_id not in own_rows
            own_rows.add(tokens.request_id)
            token = self._forced_token(tokens, budget, keep=own)
            if token is not None:
                logits[row].fill_(float("-inf"))
                logits[row, token] = 0.0

    def _forced_token(self, request: _Tokens, budget: int, keep: bool) -> int | None:
        prompt, output = request.prompt_token_ids, request.output_token_ids
        total = len(prompt) + len(output)
        scan = self._advance(self._scans.get(request.request_id, _Scan()), prompt, output)
        if keep:
            self._scans[request.request_id] = scan
        after_start = scan.after_start
        if after_start is None or (scan.after_end is not None and scan.after_end > after_start):
            return None  # not reasoning
        # The end tokens already forced (or written): the longest start of them that the tokens end with.
        recent = _tokens_from(prompt, output, max(total - len(self.end_ids) + 1, after_start))
        written = next(
            (
                k
                for k in range(min(len(recent), len(self.end_ids) - 1), 0, -1)
                if recent[-k:] == self.end_ids[:k]
            ),
            0,
        )
        if total - written - after_start < budget:
            return None
        return self.end_ids[written]

    def _advance(self, scan: _Scan, prompt: list[int], output: list[int]) -> _Scan:
        """The scan carried on over the tokens past `scan.scanned`."""
        total = len(prompt) + len(output)
        if scan.scanned == total:
            return scan
        if scan.scanned > total:  # fewer tokens than scanned: not this request's scan any more
            scan = _Scan()
        width = max(len(self.start_ids), *(len(ids) for ids in self._ends))
        first = max(scan.scanned - width + 1, 0)
        tail = _tokens_from(prompt, output, first)
        after_start, after_end = scan.after_start, scan.after_end
        for end in range(scan.scanned + 1, total + 1):
            at = end - first
            if at >= len(self.start_ids) and tail[at - len(self.start_ids) : at] == self.start_ids:
                after_start = end
            if any(at >= len(ids) and tail[at - len(ids) : at] == ids for ids in self._ends):
                after_end = end
        return replace(scan, scanned=total, after_start=after_start, after_end=after_end)


def _tokens_from(prompt: list[int], output: list[int], first: int) -> list[int]:
    """The prompt's tokens and then the output's, from index `first` on."""
    if first >= len(prompt):
        return output[first - len(prompt) :]
    return prompt[first:] + output
