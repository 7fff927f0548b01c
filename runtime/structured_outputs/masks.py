"""Applies the grammars of a step's structured-output rows to their logits, first of all (as vLLM does, so
that even raw logprobs are of what the grammar allows).

One token bitmask (a bit per vocabulary entry) is filled for the rows with grammars, in one xgrammar call,
and applied in one call. Filling does not need the logits, so when the model runs on an accelerator the model
runner starts it (`prepare`) before the forward pass, on a thread of its own (xgrammar releases the GIL), and
sampling only waits for it, if at all. On a CPU the forward pass keeps every core busy, and a thread beside it
slows it down more than the fill costs: there the fill runs at sampling time. A batch without grammars costs
one pass over its requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.request import Request
from kvfleet.runtime.structured_outputs.bitmasks import apply_bitmask

if TYPE_CHECKING:
    import xgrammar
    from kvfleet.runtime.engine.grammar_compiler import RequestGrammar


class GrammarMasks:
    def __init__(self, fill_during_forward: bool) -> None:
        # Reused from step to step, grown when a batch is larger.
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        # Made at the first grammar: xgrammar is imported only by engines that constrain.
        self._batch_matcher: xgrammar.BatchGrammarMatcher | None = None
        self._filler = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
            if fill_during_forward
            else None
        )
        # The fill started for the next sampling: its requests, and the rows it masks once done.
        self._prepared: tuple[Sequence[Request], Future[list[int]]] | None = None
        # Steps that had constrained rows, and the time spent filling and applying their masks.
        self.num_steps = 0
        self.seconds = 0.0

    def prepare(self, requests: Sequence[Request]) -> None:
        """Start filling the grammar masks of the rows about to be sampled, in this order, on the filling
        thread (with an accelerator)."""
        if self._filler is None:
            return
        if self._prepared is not None:
            # A fill nobody sampled after (its step failed) ends before the bitmask is reused.
            self._prepared[1].exception()
            self._prepared = None
        matchers = _matchers(requests)
        if matchers:
            self._prepared = (requests, self._filler.submit(self._fill_grammars, requests, matchers))

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """logits: [len(requests), vocab], modified in place: tokens a row's grammar forbids get -inf. Fills
        the grammar masks now if `prepare` was not called for these requests."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] is requests:
            masked = prepared[1].result()
        else:
            if prepared is not None:
                prepared[1].exception()
            matchers = _matchers(requests)
            masked = self._fill_grammars(requests, matchers) if matchers else []
        if not masked:
            return
        start = time.perf_counter()
        apply_bitmask(logits, self._bitmask[: len(requests)], masked)
        self.num_steps += 1
        self.seconds += time.perf_counter() - start

    def apply_after_drafts(self, logits: torch.Tensor, drafted: list[tuple[int, Request, list[int]]]) -> None:
        """Speculative decoding: for each (row, request, drafts), mask the logits rows row + 1 to
        row + len(drafts) as the request's grammar allows after its first 1, 2, ... draft tokens (which it
        allows: see RequestGrammar.allowed_prefix). Each matcher is rolled back to where it was."""
        if not drafted:
            return
        start = time.perf_counter()
        width = _grammar(drafted[0][1]).token_filter.shape[0]
        bitmask = self._bitmask_for(logits.shape[0], width)
        rows: list[int] = []
        for first_row, request, drafts in drafted:
            grammar = _grammar(request)
            matcher = grammar.matcher
            for offset, token_id in enumerate(drafts, start=1):
                if not matcher.accept_token(token_id):
                    if offset > 1:
                        matcher.rollback(offset - 1)
                    raise ValueError(f"request {request.request_id!r} drafted a token its grammar forbids")
                matcher.fill_next_token_bitmask(bitmask, first_row + offset)
                bitmask[first_row + offset] &= grammar.token_filter
                rows.append(first_row + offset)
            matcher.rollback(len(drafts))
        apply_bitmask(logits, bitmask, rows)
        self.seconds += time.perf_counter() - start

    def _fill_grammars(
        self, requests: Sequence[Request], matchers: list[tuple[int, xgrammar.GrammarMatcher]]
    ) -> list[int]:
        """Fills the bitmask rows of the requests with grammars, in one xgrammar call, and ANDs in their
        token filters, one operation for the rows that share one; returns those rows."""
        start = time.perf_counter()
        rows = [row for row, _ in matchers]
        filters = [_grammar(requests[row]).token_filter for row in rows]
        bitmask = self._bitmask_for(len(requests), filters[0].shape[0])
        if self._batch_matcher is None:
            import xgrammar

            self._batch_matcher = xgrammar.BatchGrammarMatcher()
        self._batch_matcher.batch_fill_next_token_bitmask([matcher for _, matcher in matchers], bitmask, rows)
        by_filter: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for row, token_filter in zip(rows, filters, strict=True):
            by_filter.setdefault(id(token_filter), (token_filter, []))[1].append(row)
        for token_filter, filtered in by_filter.values():
            index = torch.tensor(filtered)
            bitmask.index_copy_(0, index, bitmask.index_select(0, index) & token_filter)
        self.seconds += time.perf_counter() - start
        return rows

    def _bitmask_for(self, num_rows: int, width: int) -> torch.Tensor:
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            self._bitmask = torch.empty(max(num_rows, 2 * self._bitmask.shape[0]), width, dtype=torch.int32)
        return self._bitmask[:num_rows]


def _grammar(request: Request) -> RequestGrammar:
    assert request.grammar is not None
    return request.grammar


def _matchers(requests: Sequence[Request]) -> list[tuple[int, xgrammar.GrammarMatcher]]:
    """(row, matcher) of the requests with grammars. Made on the caller's thread, the one that advances
    them."""
    return [
        (row, request.grammar.matcher) for row, request in enumerate(requests) if request.grammar is not None
    ]
