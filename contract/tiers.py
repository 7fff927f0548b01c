"""SLA tiers: the names clients and operators use, and the engine priorities they map to.

The engine serves lower priority values first, so the most urgent tier has the smallest number: a tier's
priority is its place in TIER_NAMES. Clients may also send the integer of a tier (as vLLM's `priority`
field), within PRIORITY_RANGE: anything more urgent than `critical` would jump every tier, and anything past
`batch` means nothing more.
"""

from __future__ import annotations

from typing import Literal, get_args

TierName = Literal["critical", "high", "standard", "batch"]
TIER_NAMES: tuple[TierName, ...] = get_args(TierName)
TIERS: dict[TierName, int] = {name: priority for priority, name in enumerate(TIER_NAMES)}
# Runs on the capacity the other tiers leave, under either scheduling policy.
BACKGROUND_TIER: TierName = "batch"
PRIORITY_RANGE = (min(TIERS.values()), max(TIERS.values()))
DEFAULT_TIER: TierName = "standard"
PRIORITY_HEADER = "x-kvfleet-priority"


def parse_priority(value: int | str) -> int:
    """A tier name or a tier's integer (also as text) -> engine priority. ValueError says what is valid."""
    low, high = PRIORITY_RANGE
    expected = f"a tier name ({', '.join(TIER_NAMES)}) or an integer in [{low}, {high}]"
    if isinstance(value, bool):
        raise ValueError(f"priority must be {expected}, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TIERS:
            return TIERS[text]
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"priority must be {expected}, got {value!r}") from None
    if not low <= value <= high:
        raise ValueError(f"priority must be {expected}, got {value}")
    return value


def tier_of(priority: int) -> TierName:
    """The tier a priority is reported under: values beyond the ends (possible through the Python API)
    belong to the end tiers."""
    for name in TIER_NAMES[:-1]:
        if priority <= TIERS[name]:
            return name
    return TIER_NAMES[-1]
