"""Who goes first between two requests: the rules a replica's scheduler applies and the gateway's queue
follows, so that the gateway never holds or sends a request where the replica would treat it otherwise.

- A request displaces only a strictly less urgent one (a larger priority value); equal priorities never
  displace each other, so displacement cannot thrash.
- Background requests (the batch tier and anything less urgent) run only on the capacity the others leave:
  they start only while no other request is present.
- When a queue is full, a newcomer takes the place of the least urgent request queued, the newest of them,
  so those that have waited longest within a tier keep their place; with none less urgent than the
  newcomer, the newcomer is refused instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.contract.tiers import BACKGROUND_TIER, TIERS

BACKGROUND_PRIORITY = TIERS[BACKGROUND_TIER]


def displaces(priority: int, other: int) -> bool:
    """Whether a request of `priority` may take the place of one of `other`."""
    return priority < other


def is_background(priority: int, background_priority: int | None = BACKGROUND_PRIORITY) -> bool:
    """Whether a request of `priority` only takes the capacity others leave (never, without a background
    priority)."""
    return background_priority is not None and priority >= background_priority


def holds_background(present: Iterable[int], background_priority: int | None = BACKGROUND_PRIORITY) -> bool:
    """Whether requests of these priorities, present on a replica, keep a new background request waiting."""
    return any(not is_background(priority, background_priority) for priority in present)


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    priority: int
    arrival_time: float


def choose_victim(queued: Iterable[QueuedRequest], newcomer_priority: int) -> str | None:
    """The request a newcomer takes the place of in a full queue; None: the newcomer is refused."""
    candidates = [request for request in queued if displaces(newcomer_priority, request.priority)]
    if not candidates:
        return None
    return max(candidates, key=lambda request: (request.priority, request.arrival_time)).request_id
