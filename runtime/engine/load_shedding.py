"""Which request gives way when the waiting queue is full: the lowest tier goes first.

A newcomer may take the place of a request that has not produced anything yet and whose priority is
strictly worse (larger). Among those, the worst priority and then the newest arrival is shed, so the
requests that have waited longest within a tier keep their place. With no such request, the newcomer is
refused instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    priority: int
    arrival_time: float


def choose_victim(queued: Iterable[QueuedRequest], newcomer_priority: int) -> str | None:
    candidates = [request for request in queued if request.priority > newcomer_priority]
    if not candidates:
        return None
    return max(candidates, key=lambda request: (request.priority, request.arrival_time)).request_id
