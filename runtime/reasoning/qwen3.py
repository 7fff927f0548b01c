"""Qwen3: the answer begins with reasoning unless the chat template's `enable_thinking` switch is off (the
template then writes an empty `<think></think>` block into the prompt, and the model answers at once). The
model may write the opening `<think>` itself or find it in the prompt; an answer cut short before `</think>`
is all reasoning."""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.reasoning.think_tags import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    def opens_in_reasoning(self, template_kwargs: dict[str, Any] | None) -> bool:
        return (template_kwargs or {}).get("enable_thinking", True) is not False
