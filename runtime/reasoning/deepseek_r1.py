"""DeepSeek R1 (and QwQ): every answer begins with reasoning, which runs until `</think>`; the opening
`<think>` is written by the model or already in the prompt (R1's chat template ends with it)."""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.reasoning.think_tags import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    def opens_in_reasoning(self, template_kwargs: dict[str, Any] | None) -> bool:
        return True
