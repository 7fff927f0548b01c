"""A hook: the platform's own HTTP endpoint judges the text.

It receives `{"text", "direction": "input"|"output", "prompt"}` and answers `{"flagged": bool,
"categories": {name: score in [0, 1]}}`; categories of score 0 are not findings. A flagged text counts at any
level: the categories it names (score above 0) at score 1, or one finding of category `hook` when it names
none. A hook that fails, answers late or answers something else is unavailable, and its `failOpen` setting
decides.
"""

from __future__ import annotations

from typing import Any

import httpx
from kvfleet.runtime.safety.checker import CheckerUnavailableError, Direction, Finding
from kvfleet.runtime.safety.config import HookConfig
from kvfleet.runtime.safety.remote import post_json


class HookChecker:
    name = "hook"

    def __init__(self, config: HookConfig, client: httpx.AsyncClient) -> None:
        self.fail_open = config.fail_open
        self._config = config
        self._client = client

    async def check(self, text: str, direction: Direction, prompt: str | None) -> list[Finding]:
        body = {"text": text, "direction": direction.value, "prompt": prompt}
        answer = await post_json(
            self._client, self._config.url, body, deadline=self._config.timeout, what="the hook"
        )
        return _findings(self.name, answer)


def _findings(checker: str, answer: Any) -> list[Finding]:
    if not isinstance(answer, dict) or not isinstance(answer.get("flagged"), bool):
        raise CheckerUnavailableError("the hook's answer has no boolean 'flagged'")
    categories = answer.get("categories", {})
    if not isinstance(categories, dict) or not all(
        isinstance(score, int | float) and not isinstance(score, bool) and 0 <= score <= 1
        for score in categories.values()
    ):
        raise CheckerUnavailableError("the hook's 'categories' is not a map of scores in [0, 1]")
    named = {str(name): float(score) for name, score in categories.items() if score > 0}
    if answer["flagged"]:
        # The hook's own verdict: what it flags counts at any level, whatever scores it gives.
        return [Finding(checker, name, 1.0) for name in named] or [Finding(checker, "hook", 1.0)]
    return [Finding(checker, name, score) for name, score in named.items()]
