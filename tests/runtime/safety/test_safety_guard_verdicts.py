"""Guard-model verdicts are parsed strictly: only exactly `safe` or `unsafe` and known codes."""

from __future__ import annotations

import re

import pytest
from kvfleet.runtime.safety.checker import CheckerUnavailableError, Direction
from kvfleet.runtime.safety.guard import GUARD_CATEGORIES, VERDICT_REGEX, guard_prompt, parse_verdict


@pytest.mark.parametrize(
    ("answer", "codes"),
    [("safe", []), ("unsafe\nS1", ["S1"]), ("unsafe\nS10,S2,S10", ["S10", "S2"]), ("unsafe\nS14", ["S14"])],
)
def test_verdicts(answer: str, codes: list[str]) -> None:
    assert re.fullmatch(VERDICT_REGEX, answer)
    assert parse_verdict(answer) == codes


@pytest.mark.parametrize(
    "answer", ["", "Safe", "safe\n", " safe", "unsafe", "unsafe\n", "unsafe\nS15", "unsafe\nS1,", "unsafe S1"]
)
def test_anything_else_is_no_verdict(answer: str) -> None:
    assert re.fullmatch(VERDICT_REGEX, answer) is None
    with pytest.raises(CheckerUnavailableError):
        parse_verdict(answer)


def test_the_prompt_names_every_category_and_the_turn_judged() -> None:
    prompt = guard_prompt("the answer", Direction.OUTPUT, "the question")
    for code, (title, _) in GUARD_CATEGORIES.items():
        assert f"{code}: {title}." in prompt
    assert "User: the question\n\nAgent: the answer" in prompt
    assert "ONLY the last Agent message" in prompt
