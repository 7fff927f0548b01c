"""SLA tiers: the names clients and operators use, and the engine priorities they map to.

The engine serves lower priority values first, so the most urgent tier has the smallest number. Clients may
also send a bare integer (as vLLM's `priority` field); it is reported under the nearest tier.
"""

from __future__ import annotations

TIERS: dict[str, int] = {"critical": 0, "high": 1, "standard": 2, "batch": 3}
TIER_NAMES: tuple[str, ...] = tuple(TIERS)
DEFAULT_TIER = "standard"
PRIORITY_HEADER = "x-kvfleet-priority"


def parse_priority(value: int | str) -> int:
    """A tier name or an integer (also as text) -> engine priority. ValueError names the valid tiers."""
    if isinstance(value, bool):
        raise ValueError(
            f"priority must be a tier name ({', '.join(TIER_NAMES)}) or an integer, got {value!r}"
        )
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    if text in TIERS:
        return TIERS[text]
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"priority must be a tier name ({', '.join(TIER_NAMES)}) or an integer, got {value!r}"
        ) from None


def tier_of(priority: int) -> str:
    """The tier a priority is reported under: values beyond the ends belong to the end tiers."""
    for name in TIER_NAMES[:-1]:
        if priority <= TIERS[name]:
            return name
    return TIER_NAMES[-1]
