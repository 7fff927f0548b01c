"""The thinking budget's forced tokens (runtime.worker.thinking_budget): hand-worked cases, and random token
histories against a direct reading of the rule (each step's tokens read from the start, no scan kept); then
in the engine, against the same requests run without a budget (whose tokens the model tests hold to
Transformers), plainly and with speculative decoding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.config import EngineConfig
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
    budgets = ThinkingBudgets(START, END, END)
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
    budgets = ThinkingBudgets(START, END, END)
    request = Tokens([9], [1, 6, 2, 3, 4, 5])
    assert forced(budgets, [request]) == [None]
    request.output_token_ids += [1, 6, 6]
    assert forced(budgets, [request]) == [None]
    request.output_token_ids += [6]
    assert forced(budgets, [request]) == [2]
    # Without a start, or with a budget of 0 right after one.
    assert forced(ThinkingBudgets(START, END, END), [Tokens([5, 6, 7])], budget=0) == [None]
    assert forced(ThinkingBudgets(START, END, END), [Tokens([5, 1])], budget=0) == [2]


def test_the_models_own_end_ends_a_reasoning_whose_forced_end_is_other_text() -> None:
    # A spent budget writes 3 and 4 (a phrase), then the tag 2; the model may end with the tag alone.
    budgets = ThinkingBudgets([1], [3, 4, 2], [2])
    assert forced(budgets, [Tokens([9, 1], [6, 2, 6, 6, 6])]) == [None]
    request = Tokens([9, 1], [6, 6, 6])
    steps = []
    for token in [3, 4, 2, 5]:
        steps.append(forced(budgets, [request])[0])
        request.output_token_ids.append(token)
    steps.append(forced(budgets, [request])[0])
    assert steps == [3, 4, 2, None, None]


def test_draft_positions_count_their_drafts_and_leave_the_requests_scan_as_committed() -> None:
    budgets = ThinkingBudgets(START, END, END)
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
    budgets = ThinkingBudgets(START, END, END)
    for length in range(len(output) + 1):
        row = Tokens(prompt, output[:length])
        assert forced(budgets, [row], budget) == [_direct(prompt, output[:length], budget)]


# ---- the engine: a budget spent in the model's own tokens -------------------------------------------------

ENGINE = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def thinker(make_model: Callable[..., Path]) -> LLM:
    """A made Qwen3 model, whose tokenizer has <think> and </think>, under its reasoning parser."""
    return LLM(str(make_model("qwen3", "tiny")), reasoning_parser="qwen3", **ENGINE)  # type: ignore[arg-type]


def _tags(llm: LLM) -> tuple[int, int]:
    start, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    return start, end


def _run(llm: LLM, prompts: list[list[int]], budget: int | None, end: int) -> list[list[int]]:
    # The random model may end its reasoning itself: kept from it by a bias it cannot outweigh.
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={end: -100}, thinking_token_budget=budget
    )
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]


def test_a_spent_budget_writes_the_reasoning_end_where_the_free_run_went_on(thinker: LLM) -> None:
    start, end = _tags(thinker)
    # Reasoning opened by the prompt's last token, and three tokens before the prompt's end.
    prompts = [[100, 200, start], [100, start, 300, 301, 302], [100, 200, 300]]
    free = _run(thinker, prompts, None, end)
    budgeted = _run(thinker, prompts, 4, end)
    # The first reasons 4 tokens of its output, the second 1 more after its prompt's 3; the third never
    # reasons, and its budget has nothing to cut.
    assert budgeted[0][:5] == [*free[0][:4], end]
    assert budgeted[1][:2] == [free[1][0], end]
    assert budgeted[2] == free[2]
    assert end not in free[0] + free[1]


def test_speculative_decoding_cuts_the_reasoning_where_plain_decoding_does(
    thinker: LLM, make_model: Callable[..., Path]
) -> None:
    start, end = _tags(thinker)
    # A passage repeated, so that the n-gram proposer drafts from it.
    passage = [100, 200, 300, 400]
    prompts = [[*passage, *passage, start, *passage], [*passage, start]]
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    speculating = LLM(
        str(make_model("qwen3", "tiny")),
        reasoning_parser="qwen3",
        speculative_config=config,
        **ENGINE,  # type: ignore[arg-type]
    )
    for budget in (0, 2, 6):
        assert _run(speculating, prompts, budget, end) == _run(thinker, prompts, budget, end)
    assert speculating.llm_engine.engine_core.stats.spec_decode_num_draft_tokens > 0


def test_a_budget_without_a_reasoning_config_is_refused(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), **ENGINE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="thinking_token_budget needs the engine started with a reasoning"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, thinking_token_budget=4), use_tqdm=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"reasoning_config": {"reasoning_start": "<think>"}}, "'reasoning_start' is not one of"),
        ({"reasoning_config": {"reasoning_end_str": ""}}, "reasoning_end_str must be a non-empty string"),
        ({"reasoning_parser": "gpt_oss"}, "reasoning_parser 'gpt_oss' is not one of deepseek_r1, qwen3"),
    ],
)
def test_bad_reasoning_configs_are_refused_naming_the_field(
    tiny_llama: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_llama), **options)  # type: ignore[arg-type]
