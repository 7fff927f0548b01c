"""The safety policy's scale and its per-tier rule, shared by the runtime that enforces a policy
(`kvfleet serve --safety-config`) and the operator that merges a service's policy over the platform's and
refuses what loosens it.

A policy is a level (how low a finding's score may be and still count), an action on what counts, and the
checkers run on input and on output; `tiers` overrides any of them for the requests of one SLA tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

# From the most lenient to the strictest.
Level = Literal["off", "low", "medium", "high"]
LEVELS: tuple[Level, ...] = get_args(Level)
Action = Literal["flag", "redact", "block"]
ACTIONS: tuple[Action, ...] = get_args(Action)
# The lowest score a finding needs to count at each level (None: nothing counts).
LEVEL_THRESHOLDS: dict[Level, float | None] = {"off": None, "low": 0.9, "medium": 0.5, "high": 0.2}
DEFAULT_LEVEL: Level = "medium"
DEFAULT_ACTION: Action = "block"
# The fields that say how strict a policy is, in the order they are reported.
STRICTNESS_FIELDS = ("level", "action", "input", "output")


def tier_policy(policy: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """The policy of a tier's requests: the policy, with each field the tier's override sets (None sets
    nothing)."""
    return {**policy, **{key: value for key, value in (override or {}).items() if value is not None}}


def loosened(policy: Mapping[str, Any], than: Mapping[str, Any]) -> list[str]:
    """The STRICTNESS_FIELDS in which `policy` lets through what `than` would stop: a lower level, a weaker
    action, a checker `than` runs on input or output that it drops."""
    found = [
        key
        for key, order in (("level", LEVELS), ("action", ACTIONS))
        if _rank(order, policy[key]) < _rank(order, than[key])
    ]
    return found + [key for key in ("input", "output") if set(than[key]) - set(policy[key])]


def _rank(order: tuple[str, ...], value: str) -> int:
    # An unknown value is refused by the CRD's schema and the runtime; here it ranks as the strictest.
    return order.index(value) if value in order else len(order)
