"""Rules: blocklisted words, the platform's own patterns, and detectors of personal data and secrets.

Every finding marks its characters, so that any of them can be redacted. Detectors with a checksum (card
numbers: Luhn; IBANs: ISO 7064 mod 97) report only numbers that pass it, which keeps order numbers, phone
numbers and the like from being taken for cards.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvfleet.runtime.safety.checker import Direction, Finding
from kvfleet.runtime.safety.config import RulesConfig

BLOCKLIST_CATEGORY = "blocklist"


@dataclass(frozen=True)
class _Detector:
    category: str
    score: float
    pattern: re.Pattern[str]
    # Whether a match is really one (a checksum); None: every match is.
    valid: Callable[[str], bool] | None = None


def _luhn_valid(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for position, digit in enumerate(reversed(digits)):
        if position % 2:
            digit *= 2
            if digit > 9:
                digit -= 9
        total += digit
    return total % 10 == 0


def _iban_valid(text: str) -> bool:
    compact = "".join(text.split()).upper()
    if not 15 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(c, 36)) for c in rearranged)
    return int(number) % 97 == 1


# Each detector's name (as policies list it) -> what it finds. Scores: a card number, an IBAN or a secret is
# acted on from level "low" up; an e-mail address or a phone number from "medium".
PII_DETECTORS: dict[str, _Detector] = {
    "email": _Detector(
        "pii/email",
        0.6,
        re.compile(r"(?<![\w.+-])[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
    ),
    "phone": _Detector(
        "pii/phone",
        0.6,
        re.compile(
            # International (+CC ...) with 8-15 digits, or North American (NXX) NXX-XXXX.
            r"(?<![\w+])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}"
            r"|\(?\b[2-9]\d{2}\)?[ .-]\d{3}[ .-]\d{4})\b"
        ),
        lambda text: 8 <= sum(c.isdigit() for c in text) <= 15,
    ),
    "card": _Detector("pii/card", 0.9, re.compile(r"\b\d(?:[ -]?\d){12,18}\b"), _luhn_valid),
    "iban": _Detector("pii/iban", 0.9, re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b"), _iban_valid),
    "api_key": _Detector(
        "secrets/api_key",
        0.9,
        re.compile(
            r"\b(?:sk-(?:proj-)?[A-Za-z0-9_-]{20,}"  # OpenAI-style
            r"|AKIA[0-9A-Z]{16}"  # AWS access key id
            r"|gh[pousr]_[A-Za-z0-9]{36,}"  # GitHub tokens
            r"|github_pat_[A-Za-z0-9_]{22,}"
            r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab
            r"|xox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
            r"|AIza[0-9A-Za-z_-]{35})"  # Google API key
            r"|-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----"
        ),
    ),
}


class RuleChecker:
    name = "rules"
    fail_open = True  # rules run in-process and cannot be unavailable

    def __init__(self, config: RulesConfig) -> None:
        self._detectors = [PII_DETECTORS[name] for name in config.pii]
        for pattern in config.patterns:
            self._detectors.append(_Detector(pattern.category, pattern.score, re.compile(pattern.regex)))
        if config.blocklist:
            words = "|".join(re.escape(word) for word in sorted(config.blocklist, key=len, reverse=True))
            self._detectors.append(
                _Detector(BLOCKLIST_CATEGORY, 1.0, re.compile(rf"(?<!\w)(?:{words})(?!\w)", re.IGNORECASE))
            )

    async def check(self, text: str, direction: Direction, prompt: str | None) -> list[Finding]:
        return list(self.findings(text))

    def findings(self, text: str) -> Iterator[Finding]:
        for detector in self._detectors:
            for match in detector.pattern.finditer(text):
                if detector.valid is None or detector.valid(match.group()):
                    yield Finding(self.name, detector.category, detector.score, match.span())
