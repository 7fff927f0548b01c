"""Routing policies: which of a model's usable replicas takes a request.

A replica is usable when it is below its in-flight cap and the request has not failed on it already; the
pool decides that, the policy only picks among usable replicas.

- `round-robin`: the next usable replica in turn; the baseline.
- `least-request`: the usable replica with the fewest requests in flight (ties taken in turn).
- `prefix-hash`: consistent hashing with bounded loads (Mirrokni et al., 2018) over the first characters of
  the prompt, so requests sharing a prefix land where that prefix is cached; a replica holding more than
  `load_bound` times the mean load (counting the new request) is passed over for the next one on the ring.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

PolicyName = Literal["round-robin", "least-request", "prefix-hash"]
POLICY_NAMES: tuple[PolicyName, ...] = ("round-robin", "least-request", "prefix-hash")
DEFAULT_POLICY: PolicyName = "least-request"
DEFAULT_PREFIX_CHARS = 256
DEFAULT_LOAD_BOUND = 1.25
# Points per replica on the hash ring: enough that keys spread evenly over a handful of replicas.
RING_POINTS_PER_REPLICA = 160


@dataclass(eq=False)
class Replica:
    """One ready endpoint of a model, and the requests the gateway has in flight on it."""

    url: str
    in_flight: int = 0


Usable = Callable[[Replica], bool]


class Policy(Protocol):
    def choose(self, replicas: Sequence[Replica], prompt_text: str, usable: Usable) -> Replica | None: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[Replica], prompt_text: str, usable: Usable) -> Replica | None:
        count = len(replicas)
        for step in range(count):
            replica = replicas[(self._next + step) % count]
            if usable(replica):
                self._next = (self._next + step + 1) % count
                return replica
        return None


class LeastRequest:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[Replica], prompt_text: str, usable: Usable) -> Replica | None:
        count = len(replicas)
        best: Replica | None = None
        best_step = 0
        for step in range(count):
            replica = replicas[(self._next + step) % count]
            if usable(replica) and (best is None or replica.in_flight < best.in_flight):
                best, best_step = replica, step
        if best is not None:
            self._next = (self._next + best_step + 1) % count
        return best


class PrefixHash:
    def __init__(
        self, prefix_chars: int = DEFAULT_PREFIX_CHARS, load_bound: float = DEFAULT_LOAD_BOUND
    ) -> None:
        if load_bound < 1.0:
            raise ValueError("the load bound must be at least 1.0: below it no replica could take a request")
        self.prefix_chars = prefix_chars
        self.load_bound = load_bound
        self._ring_of: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def choose(self, replicas: Sequence[Replica], prompt_text: str, usable: Usable) -> Replica | None:
        if not replicas:
            return None
        by_url = {replica.url: replica for replica in replicas}
        self._build_ring(tuple(sorted(by_url)))
        capacity = bounded_load(replicas, self.load_bound)
        start = bisect.bisect(self._points, _hash(prompt_text[: self.prefix_chars]))
        seen: set[str] = set()
        for offset in range(len(self._points)):
            url = self._owners[(start + offset) % len(self._points)]
            if url in seen:
                continue
            seen.add(url)
            replica = by_url[url]
            if usable(replica) and replica.in_flight + 1 <= capacity:
                return replica
            if len(seen) == len(by_url):
                break
        # Replicas the request may not use can leave only ones over the bound: the least loaded of those.
        candidates = [replica for replica in replicas if usable(replica)]
        return min(candidates, key=lambda replica: replica.in_flight) if candidates else None

    def _build_ring(self, urls: tuple[str, ...]) -> None:
        if urls == self._ring_of:
            return
        points = sorted(
            (_hash(f"{url}#{index}"), url) for url in urls for index in range(RING_POINTS_PER_REPLICA)
        )
        self._ring_of = urls
        self._points = [point for point, _ in points]
        self._owners = [url for _, url in points]


def bounded_load(replicas: Sequence[Replica], load_bound: float) -> int:
    """The most requests one of `replicas` may hold under the load bound, counting the one being placed."""
    total = sum(replica.in_flight for replica in replicas) + 1
    return math.ceil(load_bound * total / len(replicas))


def make_policy(name: PolicyName, prefix_chars: int, load_bound: float) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-request":
        return LeastRequest()
    return PrefixHash(prefix_chars, load_bound)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
