"""Waiting queues: arrival order (fcfs) or (priority, arrival) order, with O(1) or O(log n) updates."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict

from kvfleet.runtime.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request in policy order."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Queue a preempted request ahead of the requests that would come after it."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The next request to admit, or None when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the request peek() returns."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take out a request that has finished while waiting."""

    @abstractmethod
    def __len__(self) -> int: ...


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        # Insertion ordered with O(1) removal by id and O(1) moves to the front.
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def prepend(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._requests.move_to_end(request.request_id, last=False)

    def peek(self) -> Request | None:
        return next(iter(self._requests.values()), None)

    def pop(self) -> Request:
        return self._requests.popitem(last=False)[1]

    def remove(self, request: Request) -> None:
        del self._requests[request.request_id]

    def __len__(self) -> int:
        return len(self._requests)


class PriorityRequestQueue(RequestQueue):
    """Lowest priority value first, then earliest arrival. A preempted request keeps its arrival time, so it
    goes ahead of every later arrival of the same priority."""

    def __init__(self) -> None:
        # Heap entries are [priority, arrival_time, sequence, request-or-None]; removal blanks the entry and
        # leaves it for peek() to drop, since a heap cannot delete from the middle cheaply.
        self._heap: list[list] = []
        self._entries: dict[str, list] = {}
        self._sequence = itertools.count()

    def add(self, request: Request) -> None:
        entry = [request.priority, request.arrival_time, next(self._sequence), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    prepend = add

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][3] is None:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        if self.peek() is None:
            raise IndexError("pop from an empty request queue")
        request = heapq.heappop(self._heap)[3]
        del self._entries[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request.request_id)
        entry[3] = None
        # Keep blanked entries from piling up when many waiting requests are aborted.
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [entry for entry in self._heap if entry[3] is not None]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._entries)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
