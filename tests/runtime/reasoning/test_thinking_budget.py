"""The thinking budget's forced tokens (runtime.worker.thinking_budget): hand-worked cases, and random token
histories against a direct reading of the rule (each step's tokens read from the start, no scan kept)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfleet.runtime.worker.thinking_budget import ThinkingBudgets

START, END = [1], [2, 3, 4]
VOCAB = 8


@dataclass
class Tokens:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    request_id: str = "r"


def forced(budgets: ThinkingBudgets, rows: list[Tokens], budget: int | None = 3) -> list[int | None]:
    """Each row's forced token (None where it may sample freely)."""
    logits = torch.zeros(len(rows), VOCAB)
    budgets.force(logits, rows, [budget] * len(rows))
    return [int(row.argmax()) if bool(torch.isinf(row).any()) else None for row in logits]


def test_the_end_tokens_are_forced_one_a_step_once_the_budget_is_spent() -> None:
    budgets = ThinkingBudgets(START, END)
    # The chat template opened the reasoning: its tokens after the start count.
    request = Tokens([9, 1, 5])
    steps = []
    for token in [6, 7, 2, 3, 4, 5]:
        steps.append(forced(budgets, [request])[0])
        request.output_token_ids.append(token)
    steps.append(forced(budgets, [request])[0])
    # 1 prompt token and 2 of output make the budget of 3; then 2, 3, 4; then the answer is free.
    assert steps == [None, None, 2, 3, 4, None, None]


def test_a_reasoning_ended_within_the_budget_is_left_alone_and_a_new_one_has_its_own() -> None:
    budgets = ThinkingBudgets(START, END)
    request = Tokens([9], [1, 6, 2, 3, 4, 5])
    assert forced(budgets, [request]) == [None]
    request.output_token_ids += [1, 6, 6]
    assert forced(budgets, [request]) == [None]
    request.output_token_ids += [6]
    assert forced(budgets, [request]) == [2]
    # Without a start, or with a budget of 0 right after one.
    assert forced(ThinkingBudgets(START, END), [Tokens([5, 6, 7])], budget=0) == [None]
    assert forced(ThinkingBudgets(START, END), [Tokens([5, 1])], budget=0) == [2]


def test_draft_positions_count_their_drafts_and_leave_the_requests_scan_as_committed() -> None:
    budgets = ThinkingBudgets(START, END)
    rows = [Tokens([9], [1, 6]), Tokens([9], [1, 6, 6]), Tokens([9], [1, 6, 6, 2])]
    assert forced(budgets, rows, budget=2) == [None, 2, 3]
    # A draft that opens a new reasoning, then rejected: the next step counts from the first start still.
    assert forced(budgets, [Tokens([9], [1, 6]), Tokens([9], [1, 6, 1])], budget=2) == [None, None]
    assert forced(budgets, [Tokens([9], [1, 6, 5])], budget=2) == [2]


def _direct(prompt: list[int], output: list[int], budget: int) -> int | None:
    """The rule read off the whole token list: reasoning after the last start that no end follows, the end
    tokens' prefix written last counted apart."""
    tokens = prompt + output

    def ends_of(sequence: list[int]) -> list[int]:
        return [i + len(sequence) for i in range(len(tokens)) if tokens[i : i + len(sequence)] == sequence]

    starts, ends = ends_of(START), ends_of(END)
    if not starts or (ends and max(ends) > max(starts)):
        return None
    after_start = max(starts)
    written = max(
        (
            k
            for k in range(1, len(END))
            if len(tokens) - k >= after_start and tokens[len(tokens) - k :] == END[:k]
        ),
        default=0,
    )
    return END[written] if len(tokens) - written - after_start >= budget else None


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    output=st.lists(st.integers(0, 5), max_size=24),
    budget=st.integers(0, 5),
)
def test_the_kept_scan_agrees_with_the_rule_read_from_the_start(
    prompt: list[int], output: list[int], budget: int
) -> None:
    budgets = ThinkingBudgets(START, END)
    for length in range(len(output) + 1):
        row = Tokens(prompt, output[:length])
        assert forced(budgets, [row], budget) == [_direct(prompt, output[:length], budget)]
