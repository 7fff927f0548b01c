"""SLA tiers: what `sla.tier` means for the scheduler, the pods and the runtime.

The chart installs one PriorityClass per tier, named `<release>-<tier>` so that two releases of the chart
can share a cluster, and tells the operator the release's prefix; a tier also sets the runtime's default
request priority and, unless the spec names one, its scheduling policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.contract.engine import SchedulingPolicy
from kvfleet.contract.tiers import TierName


@dataclass(frozen=True)
class Tier:
    name: TierName
    # PriorityClass value: a higher tier preempts a lower one when GPUs run out.
    priority_value: int
    # Batch pods wait for free GPUs rather than evicting anyone.
    preempts: bool
    scheduling_policy: SchedulingPolicy


# The chart's release name when it is installed as `kvfleet`.
DEFAULT_PRIORITY_CLASS_PREFIX = "kvfleet"


def priority_class_name(prefix: str, tier: TierName) -> str:
    """The PriorityClass of a tier's pods, as the chart names it for its release (the prefix)."""
    return f"{prefix}-{tier}"


TIERS: dict[TierName, Tier] = {
    "critical": Tier("critical", 1_000_000, True, "priority"),
    "high": Tier("high", 100_000, True, "priority"),
    "standard": Tier("standard", 10_000, True, "fcfs"),
    "batch": Tier("batch", 1_000, False, "fcfs"),
}
