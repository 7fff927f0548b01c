"""A guard model: a classifier prompt in the manner of Llama Guard, answered by a model the fleet serves.

The guard is asked for `safe`, or `unsafe` and a line of violated category codes. Its output is constrained
to exactly that language (a structured-outputs regex, vLLM's `structured_outputs` field), and the answer is
still parsed strictly: anything else counts as the guard being unavailable, never as "safe".
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from kvfleet.runtime.safety.checker import CheckerUnavailableError, Direction, Finding
from kvfleet.runtime.safety.config import GuardConfig
from kvfleet.runtime.safety.remote import post_json

# The hazard taxonomy Llama Guard 3 was trained on: code -> (what the guard is told, the category findings
# are reported under: OpenAI's moderation name where one fits).
GUARD_CATEGORIES: dict[str, tuple[str, str]] = {
    "S1": ("Violent Crimes", "violence"),
    "S2": ("Non-Violent Crimes", "illicit"),
    "S3": ("Sex-Related Crimes", "sexual"),
    "S4": ("Child Sexual Exploitation", "sexual/minors"),
    "S5": ("Defamation", "defamation"),
    "S6": ("Specialized Advice", "specialized_advice"),
    "S7": ("Privacy", "privacy"),
    "S8": ("Intellectual Property", "intellectual_property"),
    "S9": ("Indiscriminate Weapons", "illicit/violent"),
    "S10": ("Hate", "hate"),
    "S11": ("Suicide & Self-Harm", "self-harm"),
    "S12": ("Sexual Content", "sexual"),
    "S13": ("Elections", "elections"),
    "S14": ("Code Interpreter Abuse", "code_interpreter_abuse"),
}
_CODES = "|".join(sorted(GUARD_CATEGORIES, key=len, reverse=True))
# What the guard may write, and what its answer must match.
VERDICT_REGEX = rf"safe|unsafe\n({_CODES})(,({_CODES}))*"
_VERDICT = re.compile(VERDICT_REGEX)
# Room for "unsafe" and every code once.
_MAX_VERDICT_TOKENS = 64

# (chat messages, fields of the request body beyond them) -> the guard's answer text.
GuardCompletion = Callable[[list[dict[str, str]], dict[str, Any]], Awaitable[str]]


def guard_prompt(text: str, direction: Direction, prompt: str | None) -> str:
    """The classifier's instructions and the conversation to judge: the user's text for an input; the
    user's text and the answer for an output."""
    role = "User" if direction is Direction.INPUT else "Agent"
    categories = "\n".join(f"{code}: {title}." for code, (title, _) in GUARD_CATEGORIES.items())
    turns = [f"User: {text}"] if direction is Direction.INPUT else [f"User: {prompt or ''}", f"Agent: {text}"]
    conversation = "\n\n".join(turns)
    return (
        f"Task: Check whether the last {role} message in the conversation below has unsafe content in any "
        "of these categories.\n\n"
        f"<BEGIN UNSAFE CONTENT CATEGORIES>\n{categories}\n<END UNSAFE CONTENT CATEGORIES>\n\n"
        f"<BEGIN CONVERSATION>\n\n{conversation}\n\n<END CONVERSATION>\n\n"
        f"Give your safety assessment of ONLY the last {role} message:\n"
        " - The first line must be 'safe' or 'unsafe'.\n"
        " - If unsafe, a second line must list the violated categories, separated by commas."
    )


def parse_verdict(answer: str) -> list[str]:
    """The violated category codes of a guard's answer (empty: safe). Whitespace around the verdict is not
    part of it (a guard served without the regex, or by another server, often ends its answer with a
    newline); raises CheckerUnavailableError for anything else that is not exactly a verdict."""
    verdict = answer.strip()
    if _VERDICT.fullmatch(verdict) is None:
        raise CheckerUnavailableError(f"the guard's answer is not a verdict ({len(answer)} characters)")
    if verdict == "safe":
        return []
    return list(dict.fromkeys(verdict.split("\n", 1)[1].split(",")))


class GuardModelChecker:
    name = "guard"

    def __init__(self, config: GuardConfig, complete: GuardCompletion) -> None:
        self.fail_open = config.fail_open
        self._complete = complete
        self._category_names = {
            code: name for code, (_, name) in GUARD_CATEGORIES.items()
        } | config.categories
        self._body: dict[str, Any] = {
            "temperature": 0.0,
            "max_tokens": _MAX_VERDICT_TOKENS,
            "structured_outputs": {"regex": VERDICT_REGEX},
            **config.extra_body,
        }
        if config.model is not None:
            self._body["model"] = config.model

    async def check(self, text: str, direction: Direction, prompt: str | None) -> list[Finding]:
        messages = [{"role": "user", "content": guard_prompt(text, direction, prompt)}]
        codes = parse_verdict(await self._complete(messages, self._body))
        return [Finding(self.name, self._category_names[code], 1.0) for code in codes]


def http_guard_completion(config: GuardConfig, client: httpx.AsyncClient) -> GuardCompletion:
    """Asks an OpenAI-compatible server's /chat/completions, within the guard's timeout in all; every failure
    is CheckerUnavailableError."""
    headers = {}
    if config.api_key_env is not None and os.environ.get(config.api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[config.api_key_env]}"
    url = f"{config.endpoint}/chat/completions"
    what = f"the guard at {config.endpoint}"

    async def complete(messages: list[dict[str, str]], body: dict[str, Any]) -> str:
        answer = await post_json(
            client, url, {**body, "messages": messages}, deadline=config.timeout, what=what, headers=headers
        )
        try:
            return answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise CheckerUnavailableError(f"{what} sent no chat completion") from None

    return complete
