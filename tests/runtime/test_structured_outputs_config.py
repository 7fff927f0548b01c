"""vLLM's --structured-outputs-config: what kvfleet takes of it, and what it refuses, naming the field."""

from __future__ import annotations

import pytest
from kvfleet.runtime.structured_outputs.config import StructuredOutputsConfig


@pytest.mark.parametrize(
    ("value", "reasoning_parser"),
    [
        ({}, None),
        ('{"backend": "xgrammar", "disable_any_whitespace": true}', None),
        ({"backend": "auto", "disable_fallback": True, "reasoning_parser": "qwen3"}, "qwen3"),
        (
            {"reasoning_parser": "", "disable_additional_properties": False, "enable_in_reasoning": False},
            None,
        ),
    ],
)
def test_what_kvfleet_does_is_taken(value: object, reasoning_parser: str | None) -> None:
    assert StructuredOutputsConfig.parse(value).reasoning_parser == reasoning_parser  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not json", "structured_outputs_config is not valid JSON"),
        ("[]", "structured_outputs_config must be a JSON object"),
        ({"backends": "xgrammar"}, "does not take backends"),
        ({"backend": "fast"}, "backend must be one of auto, xgrammar, guidance"),
        ({"backend": "guidance"}, "backend 'guidance' is not supported"),
        ({"backend": "lm-format-enforcer"}, "backend 'lm-format-enforcer' is not supported"),
        ({"disable_any_whitespace": True}, "disable_any_whitespace needs the xgrammar backend"),
        ({"backend": "xgrammar", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or"),
        ({"backend": "xgrammar", "disable_additional_properties": True}, "guidance backend's alone"),
        ({"enable_in_reasoning": True}, "enable_in_reasoning is not supported"),
        ({"reasoning_parser_plugin": "/plugins/mine.py"}, "loads no plugins"),
        ({"reasoning_parser": 3}, "reasoning_parser must be a parser's name"),
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="structured_outputs_config") as raised:
        StructuredOutputsConfig.parse(value)  # type: ignore[arg-type]
    assert message in str(raised.value)
