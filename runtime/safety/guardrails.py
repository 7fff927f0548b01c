"""Runs a policy's checkers on a text and decides what their findings do: block it, redact it, or let it
through flagged. Counts every finding in the metrics; logs never quote the text unless the audit setting
allows it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from kvfleet.runtime.safety.checker import Checker, CheckerUnavailableError, Direction, Finding
from kvfleet.runtime.safety.config import Policy, SafetyConfig
from prometheus_client import CollectorRegistry, Counter, Histogram

logger = logging.getLogger(__name__)

# The category of a checker that failed closed.
UNAVAILABLE_CATEGORY = "checker_unavailable"
_CHECK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Decision:
    """What a policy made of one text: the findings that count at its level, and the outcome."""

    action: str
    findings: tuple[Finding, ...]
    blocked: bool
    # The text to use instead: the redacted one; the original when nothing was redacted.
    text: str

    @property
    def flagged(self) -> bool:
        return bool(self.findings)

    @property
    def categories(self) -> list[str]:
        return sorted({finding.category for finding in self.findings})

    def explanation(self, direction: Direction) -> str:
        what = "input" if direction is Direction.INPUT else "output"
        named = ", ".join(
            f"{category} ({', '.join(sorted({f.checker for f in self.findings if f.category == category}))})"
            for category in self.categories
        )
        return f"the {what} was found to contain {named}, which this service's safety policy does not allow"


class SafetyMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        self.findings = Counter(
            "kvfleet:safety_findings",
            "Findings that counted under the policy, by checker, category, direction and the action taken.",
            ["model_name", "checker", "category", "direction", "action"],
            registry=registry,
        )
        self.check_seconds = Histogram(
            "kvfleet:safety_check_seconds",
            "Time one checker took on one text.",
            ["model_name", "checker", "direction"],
            buckets=_CHECK_BUCKETS,
            registry=registry,
        )
        self.unavailable = Counter(
            "kvfleet:safety_checker_unavailable",
            "Checks a checker could not give (outcome: open let the text through, closed blocked it).",
            ["model_name", "checker", "outcome"],
            registry=registry,
        )


class Guardrails:
    def __init__(self, config: SafetyConfig, checkers: dict[str, Checker], metrics: SafetyMetrics) -> None:
        self.config = config
        self._checkers = checkers
        self._metrics = metrics

    def policy(self, tier: str | None) -> Policy:
        return self.config.policy(tier)

    def checks(self, policy: Policy, direction: Direction) -> bool:
        names = policy.input if direction is Direction.INPUT else policy.output
        return policy.threshold is not None and bool(names)

    async def findings(
        self, names: tuple[str, ...], text: str, direction: Direction, prompt: str | None = None
    ) -> list[Finding]:
        """Every finding of the named checkers on `text`, whatever its score; a checker that cannot tell
        is left out when it fails open and reported as one finding of UNAVAILABLE_CATEGORY when closed."""
        results = await asyncio.gather(
            *(self._run(self._checkers[name], text, direction, prompt) for name in names)
        )
        return [finding for findings in results for finding in findings]

    async def check(
        self, policy: Policy, text: str, direction: Direction, prompt: str | None = None
    ) -> Decision:
        if not self.checks(policy, direction):
            return Decision(policy.action, (), False, text)
        names = policy.input if direction is Direction.INPUT else policy.output
        threshold = policy.threshold
        assert threshold is not None
        counted = tuple(
            finding
            for finding in await self.findings(names, text, direction, prompt)
            if finding.score >= threshold or finding.category == UNAVAILABLE_CATEGORY
        )
        decision = _decide(policy.action, counted, text)
        if counted:
            self._report(decision, direction, text)
        return decision

    async def _run(
        self, checker: Checker, text: str, direction: Direction, prompt: str | None
    ) -> list[Finding]:
        started = time.perf_counter()
        try:
            return await checker.check(text, direction, prompt)
        except CheckerUnavailableError as exc:
            outcome = "open" if checker.fail_open else "closed"
            self._metrics.unavailable.labels(self._metrics.model_name, checker.name, outcome).inc()
            logger.warning("safety checker %r unavailable (failing %s): %s", checker.name, outcome, exc)
            return [] if checker.fail_open else [Finding(checker.name, UNAVAILABLE_CATEGORY, 1.0)]
        finally:
            self._metrics.check_seconds.labels(
                self._metrics.model_name, checker.name, direction.value
            ).observe(time.perf_counter() - started)

    def _report(self, decision: Decision, direction: Direction, text: str) -> None:
        outcome = "block" if decision.blocked else decision.action
        for finding in decision.findings:
            self._metrics.findings.labels(
                self._metrics.model_name, finding.checker, finding.category, direction.value, outcome
            ).inc()
        if self.config.audit.log_content:
            logger.info("safety %s %s: %s; text: %r", direction.value, outcome, decision.categories, text)
        else:
            logger.info("safety %s %s: %s", direction.value, outcome, decision.categories)


def _decide(action: str, findings: tuple[Finding, ...], text: str) -> Decision:
    if not findings or action == "flag":
        return Decision(action, findings, False, text)
    if action == "block" or any(finding.span is None for finding in findings):
        # A finding about the text as a whole cannot be redacted away.
        return Decision(action, findings, True, text)
    return Decision(action, findings, False, redact(text, findings))


def redact(text: str, findings: tuple[Finding, ...] | list[Finding]) -> str:
    """`text` with every finding's span replaced by a marker naming its category; overlapping spans merge
    under the first one's category."""
    spans = sorted((f.span, f.category) for f in findings if f.span is not None)
    pieces, position = [], 0
    for (start, end), category in spans:
        if end <= position:
            continue
        if start >= position:
            pieces.append(text[position:start])
            pieces.append(f"[REDACTED:{category}]")
        position = end
    pieces.append(text[position:])
    return "".join(pieces)


def redact_pieces(pieces: list[str], findings: tuple[Finding, ...]) -> list[str]:
    """`redact` over a text that was checked as the concatenation of `pieces`, done piece by piece: each
    piece gets the markers of the spans that reach into it, so whatever lies between the pieces (a message's
    images) keeps its place."""
    redacted, start = [], 0
    for piece in pieces:
        end = start + len(piece)
        inside = [
            replace(f, span=(max(f.span[0], start) - start, min(f.span[1], end) - start))
            for f in findings
            if f.span is not None and f.span[0] < end and f.span[1] > start
        ]
        redacted.append(redact(piece, inside))
        start = end
    return redacted
