"""The interface every checker implements, and what a check finds."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Direction(enum.Enum):
    INPUT = "input"
    OUTPUT = "output"


@dataclass(frozen=True)
class Finding:
    """One category a checker found in a text. `score` is in [0, 1]: how sure, or how severe; the policy's
    level decides from which score a finding counts. `span` (start, end) marks the characters a redaction
    replaces; findings about the text as a whole (a guard model's verdict) have none."""

    checker: str
    category: str
    score: float
    span: tuple[int, int] | None = None


class CheckerUnavailableError(Exception):
    """A checker that depends on another service could not give a verdict (down, too slow, or an answer
    that is not a verdict)."""


class Checker(Protocol):
    # The name policies list the checker under, and metrics label it with.
    name: str
    # What a failure to check means: True lets the text through, False blocks it.
    fail_open: bool

    async def check(self, text: str, direction: Direction, prompt: str | None) -> list[Finding]:
        """The findings in `text`. `prompt` is the request's last user text when `text` is an output, for
        checkers that judge an answer in its context. Raises CheckerUnavailableError when it cannot tell."""
        ...
