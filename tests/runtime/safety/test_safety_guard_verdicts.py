"""Guard-model verdicts are parsed strictly: only exactly `safe` or `unsafe` and known codes, whitespace
around them aside. What a hook flags counts, whatever its scores."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest
from kvfleet.runtime.safety.checker import CheckerUnavailableError, Direction
from kvfleet.runtime.safety.config import HookConfig
from kvfleet.runtime.safety.guard import GUARD_CATEGORIES, VERDICT_REGEX, guard_prompt, parse_verdict
from kvfleet.runtime.safety.hook import HookChecker


@pytest.mark.parametrize(
    ("answer", "codes"),
    [("safe", []), ("unsafe\nS1", ["S1"]), ("unsafe\nS10,S2,S10", ["S10", "S2"]), ("unsafe\nS14", ["S14"])],
)
def test_verdicts(answer: str, codes: list[str]) -> None:
    assert re.fullmatch(VERDICT_REGEX, answer)
    assert parse_verdict(answer) == codes


@pytest.mark.parametrize(
    ("answer", "codes"), [("safe\n", []), (" safe ", []), ("\nunsafe\nS1,S2\n", ["S1", "S2"])]
)
def test_whitespace_around_a_verdict_is_not_part_of_it(answer: str, codes: list[str]) -> None:
    assert parse_verdict(answer) == codes


@pytest.mark.parametrize(
    "answer",
    ["", " ", "Safe", "safe.", "unsafe", "unsafe\n", "unsafe\nS15", "unsafe\nS1,", "unsafe S1", "safe\nsafe"],
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


@pytest.mark.parametrize(
    ("answer", "findings"),
    [
        ({"flagged": True, "categories": {"custom": 0.0}}, [("hook", 1.0)]),
        ({"flagged": True, "categories": {"custom": 0.3, "other": 0.0}}, [("custom", 1.0)]),
        ({"flagged": True}, [("hook", 1.0)]),
        ({"flagged": False, "categories": {"custom": 0.3, "other": 0.0}}, [("custom", 0.3)]),
    ],
)
def test_a_hook_that_flags_a_text_is_a_finding_at_any_level(
    answer: dict[str, Any], findings: list[tuple[str, float]]
) -> None:
    async def check() -> list[tuple[str, float]]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
        async with httpx.AsyncClient(transport=transport) as client:
            checker = HookChecker(HookConfig(url="http://127.0.0.1:9/hook"), client)
            found = await checker.check("some text", Direction.INPUT, None)
        return [(finding.category, finding.score) for finding in found]

    assert asyncio.run(check()) == findings
