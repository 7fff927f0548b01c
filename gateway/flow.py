"""Flow control: one bounded, tier-ordered queue per model in front of its replicas.

A request goes straight to a replica when nobody is waiting and a usable replica exists (below its in-flight
cap, not already tried by this request). Otherwise it waits in its model's queue, ordered by tier (critical
first) and FIFO within a tier, and is handed a replica as soon as one frees up or appears: a model scaled to
zero holds its requests until a replica is ready. The wait is bounded by the hold time and the request's own
deadline. A full queue sheds its newest request of the lowest tier for a more urgent arrival, and refuses an
arrival that is no more urgent than everything queued.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.routing import Policy, Replica, make_policy
from kvfleet.runtime.server.openai_errors import (
    NotFoundError,
    OpenAIError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvfleet.runtime.server.priorities import tier_of

DEFAULT_MAX_QUEUE = 1024


@dataclass(order=True)
class _Waiter:
    priority: int
    sequence: int
    prompt_text: str = field(compare=False)
    tried: frozenset[str] = field(compare=False)
    future: asyncio.Future[Replica] = field(compare=False)


class ModelPool:
    """A model's replicas, its routing policy and its queue."""

    def __init__(self, config: ModelConfig, max_queue: int, metrics: GatewayMetrics) -> None:
        self.config = config
        self.max_queue = max_queue
        self.metrics = metrics
        self.replicas = [Replica(url) for url in config.endpoints]
        self.policy: Policy = make_policy(config.policy, config.prefix_chars, config.load_bound)
        self._heap: list[_Waiter] = []
        self._waiting = 0
        self._sequence = itertools.count()

    def reconfigure(self, config: ModelConfig) -> None:
        """New endpoints or settings; replicas that stay keep their in-flight counts."""
        known = {replica.url: replica for replica in self.replicas}
        self.replicas = [known.get(url) or Replica(url) for url in config.endpoints]
        routing = (config.policy, config.prefix_chars, config.load_bound)
        if routing != (self.config.policy, self.config.prefix_chars, self.config.load_bound):
            self.policy = make_policy(*routing)
        self.config = config
        self._dispatch()

    def close(self) -> None:
        """The model left the fleet: whoever waits for it learns so."""
        for waiter in self._heap:
            if not waiter.future.done():
                waiter.future.set_exception(
                    NotFoundError(f"the model {self.config.name!r} was removed", code="model_not_found")
                )
        self._heap.clear()
        self._set_waiting(0)

    async def acquire(
        self,
        priority: int,
        prompt_text: str,
        tried: Iterable[str] = (),
        deadline_seconds: float | None = None,
    ) -> Replica:
        """A replica with one more request in flight on it; the caller must `release` it."""
        tried = frozenset(tried)
        if self._waiting == 0:
            replica = self._choose(prompt_text, tried)
            if replica is not None:
                replica.in_flight += 1
                return replica
        waiter = _Waiter(
            priority, next(self._sequence), prompt_text, tried, asyncio.get_running_loop().create_future()
        )
        self._admit(waiter)
        hold = self.config.hold_seconds
        limit = hold if deadline_seconds is None else min(hold, deadline_seconds)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), limit)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()
            deadline_binding = deadline_seconds is not None and deadline_seconds < hold
            raise self._timed_out(priority, tried, deadline_binding) from None
        except asyncio.CancelledError:
            # The client left: a replica handed over meanwhile goes back.
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result())
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
                self._set_waiting(self._waiting - 1)
                self._compact()

    def release(self, replica: Replica) -> None:
        replica.in_flight -= 1
        if self._waiting:
            self._dispatch()

    def _usable(self, tried: frozenset[str]) -> tuple[Replica, ...]:
        cap = self.config.max_in_flight
        return tuple(r for r in self.replicas if r.in_flight < cap and r.url not in tried)

    def _choose(self, prompt_text: str, tried: frozenset[str]) -> Replica | None:
        cap = self.config.max_in_flight
        return self.policy.choose(
            self.replicas, prompt_text, lambda replica: replica.in_flight < cap and replica.url not in tried
        )

    def _admit(self, waiter: _Waiter) -> None:
        """Queues the waiter, shedding the least urgent one queued if the queue is full."""
        if self._waiting >= self.max_queue:
            live = [queued for queued in self._heap if not queued.future.done()]
            victim = max(live)
            if waiter > victim:
                self.metrics.rejected.labels(self.config.name, "queue_full", tier_of(waiter.priority)).inc()
                raise OverloadedError(
                    f"the queue of model {self.config.name!r} is full ({self.max_queue} requests), "
                    "none of them less urgent than this one",
                    code="queue_full",
                )
            self.metrics.rejected.labels(self.config.name, "shed", tier_of(victim.priority)).inc()
            victim.future.set_exception(
                OverloadedError(
                    f"shed from the full queue of model {self.config.name!r} for a more urgent request",
                    code="shed",
                )
            )
            self._set_waiting(self._waiting - 1)
        heapq.heappush(self._heap, waiter)
        self._set_waiting(self._waiting + 1)

    def _dispatch(self) -> None:
        """Hands free replicas to the queue's head, in tier and arrival order."""
        parked = []
        while self._heap:
            waiter = self._heap[0]
            if waiter.future.done():
                heapq.heappop(self._heap)
                continue
            replica = self._choose(waiter.prompt_text, waiter.tried)
            if replica is None:
                if waiter.tried and self._usable(frozenset()):
                    # Only replicas this request already failed on are free: the next waiter may take one.
                    parked.append(heapq.heappop(self._heap))
                    continue
                break
            heapq.heappop(self._heap)
            replica.in_flight += 1
            waiter.future.set_result(replica)
            self._set_waiting(self._waiting - 1)
        for waiter in parked:
            heapq.heappush(self._heap, waiter)

    def _compact(self) -> None:
        """Drops the entries of waiters that left, once they outnumber the live ones."""
        if len(self._heap) > 2 * self._waiting + 16:
            self._heap = [waiter for waiter in self._heap if not waiter.future.done()]
            heapq.heapify(self._heap)

    def _timed_out(self, priority: int, tried: frozenset[str], deadline_binding: bool) -> OpenAIError:
        name, tier = self.config.name, tier_of(priority)
        if not self._usable(tried) and all(replica.url in tried for replica in self.replicas):
            self.metrics.rejected.labels(name, "unavailable", tier).inc()
            return ServiceUnavailableError(
                f"no replica of model {name!r} could serve the request within {self.config.hold_seconds:g} s",
                code="no_ready_replica",
            )
        reason = "deadline" if deadline_binding else "hold_time"
        self.metrics.rejected.labels(name, reason, tier).inc()
        message = (
            "the request's deadline passed"
            if deadline_binding
            else f"no replica was free within {self.config.hold_seconds:g} s"
        )
        return OverloadedError(
            f"{message} while every replica of model {name!r} was busy",
            code="deadline_exceeded" if deadline_binding else "queue_timeout",
        )

    def _set_waiting(self, count: int) -> None:
        self._waiting = count
        self.metrics.queue_depth.labels(self.config.name).set(count)


class Fleet:
    """Every model's pool, kept in step with what discovery publishes."""

    def __init__(self, max_queue: int, metrics: GatewayMetrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.pools: dict[str, ModelPool] = {}

    def update(self, models: Mapping[str, ModelConfig]) -> None:
        for name in list(self.pools):
            if name not in models:
                self.pools.pop(name).close()
                self.metrics.forget(name)
        for name, config in models.items():
            pool = self.pools.get(name)
            if pool is None:
                self.pools[name] = ModelPool(config, self.max_queue, self.metrics)
                self.metrics.queue_depth.labels(name).set(0)
            elif pool.config != config:
                pool.reconfigure(config)
            self.metrics.ready_replicas.labels(name).set(len(config.endpoints))
