"""SLA tiers: what `sla.tier` means for the scheduler, the pods and the runtime.

The chart installs one PriorityClass per tier; a tier also sets the runtime's default request priority
and, unless the spec names one, its scheduling policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.contract.engine import SchedulingPolicy
from kvfleet.contract.tiers import TierName


@dataclass(frozen=True)
class Tier:
    name: TierName
    priority_class: str
    # PriorityClass value: a higher tier preempts a lower one when GPUs run out.
    priority_value: int
    # Batch pods wait for free GPUs rather than evicting anyone.
    preempts: bool
    scheduling_policy: SchedulingPolicy


TIERS: dict[TierName, Tier] = {
    "critical": Tier("critical", "kvfleet-critical", 1_000_000, True, "priority"),
    "high": Tier("high", "kvfleet-high", 100_000, True, "priority"),
    "standard": Tier("standard", "kvfleet-standard", 10_000, True, "fcfs"),
    "batch": Tier("batch", "kvfleet-batch", 1_000, False, "fcfs"),
}
