"""Reasoning parsers: how a reasoning model's output splits into its reasoning and its answer (the chat
message's `reasoning_content`), one module per model family, bound by name (--reasoning-parser) to the
served model's tokenizer."""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvfleet.runtime.reasoning.qwen3 import Qwen3ReasoningParser
from kvfleet.runtime.reasoning.think_tags import ReasoningParser, ReasoningSplit, ReasoningStream

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "reasoning_parser",
]


def reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser named `name`, bound to the tokenizer; ValueError for an unknown name or a tokenizer that
    lacks the parser's tags."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"{name!r} is not one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](tokenizer)
