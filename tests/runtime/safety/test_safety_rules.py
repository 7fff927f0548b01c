"""The rule checker on a labelled set of inputs and outputs (rule_cases.json): every unsafe text found with
exactly its categories, and the false-positive rate on the safe half reported."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from kvfleet.runtime.safety.checker import Direction
from kvfleet.runtime.safety.config import SafetyConfig, parse_safety_config
from kvfleet.runtime.safety.guardrails import Decision, Guardrails, SafetyMetrics, redact, redact_pieces
from kvfleet.runtime.safety.rules import RuleChecker
from prometheus_client import CollectorRegistry

CASES = json.loads((Path(__file__).parent / "rule_cases.json").read_text())
# The most safe texts the rules may flag: 2%.
MAX_FALSE_POSITIVE_RATE = 0.02


def _guardrails(config: SafetyConfig) -> Guardrails:
    assert config.rules is not None
    metrics = SafetyMetrics("tiny", CollectorRegistry())
    return Guardrails(config, {"rules": RuleChecker(config.rules)}, metrics)


def _decide(guardrails: Guardrails, text: str, direction: str) -> Decision:
    policy = guardrails.policy(None)
    return asyncio.run(guardrails.check(policy, text, Direction(direction)))


def test_the_set_is_large_and_balanced() -> None:
    unsafe = [case for case in CASES["cases"] if case["categories"]]
    safe = [case for case in CASES["cases"] if not case["categories"]]
    assert len(CASES["cases"]) >= 100
    assert len(unsafe) >= 50 and len(safe) >= 50
    assert {case["direction"] for case in unsafe} == {"input", "output"}


def test_every_unsafe_text_is_found_with_its_categories(capsys: pytest.CaptureFixture[str]) -> None:
    guardrails = _guardrails(SafetyConfig.model_validate(CASES["config"]))
    missed, false_positives, safe = [], [], 0
    for case in CASES["cases"]:
        decision = _decide(guardrails, case["text"], case["direction"])
        if case["categories"]:
            if decision.categories != sorted(case["categories"]) or not decision.blocked:
                missed.append((case["text"], decision.categories))
        else:
            safe += 1
            if decision.flagged:
                false_positives.append((case["text"], decision.categories))
    rate = len(false_positives) / safe
    with capsys.disabled():
        print(f"\nrules: false-positive rate {rate:.1%} ({len(false_positives)} of {safe} safe texts)")
    assert not missed
    assert rate <= MAX_FALSE_POSITIVE_RATE, false_positives


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("off", []),
        ("low", ["pii/card"]),
        ("medium", ["pii/card", "pii/email"]),
        ("high", ["pii/card", "pii/email", "review"]),
    ],
)
def test_the_level_sets_which_scores_count(level: str, expected: list[str]) -> None:
    config = SafetyConfig.model_validate(
        {
            "level": level,
            "input": ["rules"],
            "rules": {"patterns": [{"category": "review", "regex": "refund", "score": 0.3}]},
        }
    )
    decision = _decide(
        guardrails=_guardrails(config), text="refund a@b.io on 4111111111111111", direction="input"
    )
    assert decision.categories == expected


def test_redaction_replaces_exactly_the_findings() -> None:
    config = SafetyConfig.model_validate({"action": "redact", "input": ["rules"], "rules": {}})
    text = "mail jane@example.com or pay 4111 1111 1111 1111 today"
    decision = _decide(_guardrails(config), text, "input")
    assert not decision.blocked
    assert decision.text == "mail [REDACTED:pii/email] or pay [REDACTED:pii/card] today"


def test_overlapping_spans_redact_once() -> None:
    checker = RuleChecker(SafetyConfig.model_validate({"rules": {"blocklist": ["ab", "abc d"]}}).rules)  # type: ignore[arg-type]
    findings = list(checker.findings("x abc d ab y"))
    assert redact("x abc d ab y", findings) == "x [REDACTED:blocklist] [REDACTED:blocklist] y"


def test_flag_lets_the_text_through() -> None:
    config = SafetyConfig.model_validate({"action": "flag", "input": ["rules"], "rules": {}})
    decision = _decide(_guardrails(config), "jane@example.com", "input")
    assert decision.flagged and not decision.blocked and decision.text == "jane@example.com"


def test_a_tier_override_changes_only_what_it_names() -> None:
    config = parse_safety_config(
        '{"input": ["rules"], "rules": {}, "refusal": "No.", "tiers": {"batch": {"action": "flag"}}}'
    )
    assert config.policy("batch").action == "flag"
    assert config.policy("batch").refusal == "No."
    assert config.policy("standard").action == "block"


@pytest.mark.parametrize(
    ("tier", "override", "claimed"),
    [
        ("high", {"level": "high", "input": ["rules", "hook"]}, True),
        ("batch", {"action": "flag"}, False),
        ("critical", {"action": "redact"}, False),
        ("batch", {"level": "low"}, False),
        ("batch", {"input": []}, False),
        ("batch", {"output": ["hook"]}, False),
        ("batch", {"refusal": "Not in batch.", "windowTokens": 64}, True),
    ],
)
def test_a_claimed_tier_may_only_tighten_the_default_tiers_policy(
    tier: str, override: dict[str, Any], claimed: bool
) -> None:
    policy = {"input": ["rules"], "output": ["rules"], "rules": {}, "hook": {"url": "http://127.0.0.1:9/"}}
    config = SafetyConfig.model_validate({**policy, "tiers": {tier: override}})
    expected = config.policy(tier) if claimed else config.policy("standard")
    assert config.claimed_policy(tier, "standard") == expected
    allowing = SafetyConfig.model_validate({**policy, "tiers": {tier: override}, "allowLooserTiers": True})
    assert allowing.claimed_policy(tier, "standard") == config.policy(tier)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"input": ["guard"]}', "runs the 'guard' checker, which is not configured"),
        ('{"levle": "low"}', "levle: Extra inputs are not permitted"),
        ('{"level": "extreme"}', "level: Input should be 'off', 'low', 'medium' or 'high'"),
        ('{"tiers": {"gold": {}}}', "unknown tier 'gold'"),
        ('{"rules": {"patterns": [{"category": "x", "regex": "("}]}}', "not a valid regular expression"),
        ('{"guard": {"endpoint": "guard:8000"}}', "must be 'self' or an http(s) URL"),
        ("{not json", "not valid JSON"),
        ("/nonexistent/safety.json", "cannot read the safety config file"),
    ],
)
def test_a_bad_config_is_refused_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_safety_config(text)


def test_pieces_are_redacted_where_their_spans_fall() -> None:
    config = SafetyConfig.model_validate({"action": "redact", "input": ["rules"], "rules": {}})
    pieces = ["mail jane@example.com", " and ", "pay 4111 1111 1111 1111 today"]
    decision = _decide(_guardrails(config), "".join(pieces), "input")
    # No span crosses a piece's edge: the pieces put together are the whole text redacted.
    redacted = redact_pieces(pieces, decision.findings)
    assert redacted == ["mail [REDACTED:pii/email]", " and ", "pay [REDACTED:pii/card] today"]
    assert "".join(redacted) == decision.text
    # A span across an edge leaves a marker on each side of it.
    split = ["mail jane@exa", "mple.com now"]
    decision = _decide(_guardrails(config), "".join(split), "input")
    assert redact_pieces(split, decision.findings) == [
        "mail [REDACTED:pii/email]",
        "[REDACTED:pii/email] now",
    ]
    # An empty piece inside a span gets no marker of its own.
    around = ["mail jane@", "", "example.com now"]
    decision = _decide(_guardrails(config), "".join(around), "input")
    assert redact_pieces(around, decision.findings) == [
        "mail [REDACTED:pii/email]",
        "",
        "[REDACTED:pii/email] now",
    ]
