"""Flow control: one bounded, tier-ordered queue per model in front of its replicas.

A request goes straight to a replica when nobody is waiting and a usable replica exists (below its in-flight
cap, not already tried by this request). Otherwise it waits in its model's queue, ordered by tier (critical
first) and FIFO within a tier, and is handed a replica as soon as one frees up or appears: a model scaled to
zero holds its requests until a replica is ready. The wait is bounded by the hold time and the request's own
deadline. A full queue sheds its newest request of the lowest tier for a more urgent arrival, and refuses an
arrival that is no more urgent than everything queued.

How a replica's cap is counted depends on its scheduling policy. A replica that preempts (`priority`) makes
room for an urgent request itself, so a request counts only the requests in flight there that are at least as
urgent: holding a critical request behind batch work would only delay it. A first-come, first-served replica
never makes room, so every request in flight counts, and the less urgent tiers leave places free for the more
urgent tiers that sent requests in the last minute (an eighth of the cap per tier of difference from the most
urgent of them, at least one, never all; a model whose requests are all of one tier keeps nothing): the
gateway's queue is then the only place where requests wait, and a critical request finds a place at once.
Background (batch) requests go there only while no other request is in flight, as the replica itself would
start them only then. Who displaces whom, the background hold and which request a full queue sheds are the
replica's own rules (kvfleet.contract.precedence).

A LoRA adapter is a model of its own whose replicas are those of its base model that serve it. A replica is
one object shared by every model routed to it, so its in-flight cap counts the requests of all of them, and a
place it frees is offered to the queue of each of those models. An adapter's requests go first to the
replicas already running requests of it (the adapter is in their GPU slots: nothing has to be swapped in),
as long as those stay within the load bound.

A model with prefill replicas (disaggregated prefill and decode) routes its requests to its decode replicas
as above, and has a second pool for its prefill replicas, with the same policy and rules and in-flight counts
of its own. That pool never queues: a request that finds no prefill replica with room at once is prefilled
by its decode replica instead, as Dynamo's disaggregated router does when its prefill queue is full. It is
asked only once the request holds its decode replica.

Names: an InferenceService's model is routed as `NAMESPACE/SERVED_NAME` and its adapters as
`NAMESPACE/ADAPTER` (kvfleet.operator.api.qualified_name), so a service in one namespace can take no name of
another's. A bare name reaches the services of one namespace only, the one the platform names
(`Fleet.resolve`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvfleet.contract.errors import (
    NotFoundError,
    OpenAIError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvfleet.contract.precedence import QueuedRequest, choose_victim, holds_background, is_background
from kvfleet.contract.routing import PolicyName
from kvfleet.contract.tiers import PRIORITY_RANGE, tier_of
from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.kv_index import KVBlockIndex
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.routing import Decision, Policy, Prompt, Replica, bounded_load, make_policy
from kvfleet.operator.api import qualified_name

DEFAULT_MAX_QUEUE = 1024
# The adapters a replica serves: each one's lora_int_id there by name, None where the replica does not say.
AdapterIds = Mapping[str, int | None]
URGENT_TIER_MEMORY_S = 60.0


@dataclass(order=True)
class _Waiter:
    priority: int
    sequence: int
    prompt: Prompt = field(compare=False)
    tried: frozenset[str] = field(compare=False)
    future: asyncio.Future[Replica] = field(compare=False)


def _places_kept_for_more_urgent(tiers_below_most_urgent: int, cap: int) -> int:
    """The places of a first-come, first-served replica that a request leaves free for more urgent ones."""
    if tiers_below_most_urgent <= 0:
        return 0
    return min(cap - 1, max(1, math.ceil(cap * tiers_below_most_urgent / 8)))


class ModelPool:
    """A model's replicas, its routing policy and its queue."""

    def __init__(
        self,
        config: ModelConfig,
        max_queue: int,
        metrics: GatewayMetrics,
        replica_for: Callable[[str], Replica] = Replica,
        kv_index: KVBlockIndex | None = None,
    ) -> None:
        """`replica_for(url)`: the replica at url, shared with the other models routed to it; `kv_index`: the
        replicas' cached blocks, for the precise-prefix policy."""
        self.config = config
        self.max_queue = max_queue
        self.metrics = metrics
        self._replica_for = replica_for
        self._kv_index = kv_index
        self.replicas = [replica_for(url) for url in config.endpoints]
        # This model's own requests in flight, by replica URL (a replica's in_flight counts every model's).
        self._running: Counter[str] = Counter()
        # Told of every place a replica of this model frees; the fleet offers it to every model routed there.
        self.on_release: Callable[[Replica], None] = lambda replica: self.dispatch()
        self.policy: Policy = self._policy(config)
        # The model's prefill replicas, when it has any; their places are asked with `try_acquire` only, so
        # nobody ever waits in this pool (and it never counts in the model's queue depth).
        self.prefill: ModelPool | None = self._prefill_pool(config)
        self._heap: list[_Waiter] = []
        # When a request of each priority last arrived: places are kept only for tiers still asking.
        self._last_seen: dict[int, float] = {}
        self._waiting = 0
        self._sequence = itertools.count()

    def reconfigure(self, config: ModelConfig) -> None:
        """New endpoints or settings; replicas that stay keep their in-flight counts."""
        known = {replica.url: replica for replica in self.replicas}
        self.replicas = [known.get(url) or self._replica_for(url) for url in config.endpoints]
        routing = (config.policy, config.prefix_chars, config.load_bound)
        if routing != (self.config.policy, self.config.prefix_chars, self.config.load_bound):
            self.policy = self._policy(config)
        if self.prefill is None or not config.prefill_endpoints:
            self.prefill = self._prefill_pool(config)
        else:
            self.prefill.reconfigure(_prefill_config(config))
        self.config = config
        self._dispatch()

    def _policy(self, config: ModelConfig) -> Policy:
        def record(decision: Decision) -> None:
            self.metrics.precise.decisions.labels(config.name, decision.reason).inc()
            for medium, blocks in (
                ("device", decision.match.device_blocks),
                ("host", decision.match.host_blocks),
            ):
                if blocks:
                    self.metrics.precise.hit_blocks.labels(config.name, medium).inc(blocks)

        return make_policy(config.policy, config.prefix_chars, config.load_bound, self._kv_index, record)

    def _prefill_pool(self, config: ModelConfig) -> ModelPool | None:
        if not config.prefill_endpoints:
            return None
        pool = ModelPool(
            _prefill_config(config), self.max_queue, self.metrics, self._replica_for, self._kv_index
        )
        # A place a prefill replica frees goes where this model's places go (the fleet offers it to the models
        # whose queues the same replica serves).
        pool.on_release = lambda replica: self.on_release(replica)
        return pool

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
        prompt: Prompt,
        tried: Iterable[str] = (),
        deadline_seconds: float | None = None,
    ) -> Replica:
        """A replica with one more request in flight on it; the caller must `release` it."""
        tried = frozenset(tried)
        replica = self.try_acquire(priority, prompt, tried)
        if replica is not None:
            return replica
        waiter = _Waiter(
            priority, next(self._sequence), prompt, tried, asyncio.get_running_loop().create_future()
        )
        self._admit(waiter)
        # Those waiting may all be less urgent, with no room for them but room for this one.
        self._dispatch()
        if not waiter.future.done():
            self.metrics.held.labels(self.config.name, tier_of(priority)).inc()
        hold = self.config.hold_seconds
        limit = hold if deadline_seconds is None else min(hold, deadline_seconds)
        try:
            async with asyncio.timeout(limit):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()
            deadline_binding = deadline_seconds is not None and deadline_seconds < hold
            raise self._timed_out(priority, tried, deadline_binding) from None
        except asyncio.CancelledError:
            # The client left: a replica handed over meanwhile goes back.
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result(), priority)
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
                self._set_waiting(self._waiting - 1)
                self._compact()

    def try_acquire(
        self, priority: int, prompt: Prompt, tried: frozenset[str] = frozenset()
    ) -> Replica | None:
        """A replica with room for one more request now, which the caller must `release`; None when there is
        none, or when others wait already (who come first). Never waits."""
        self._last_seen[priority] = time.monotonic()
        if self._waiting:
            return None
        replica = self._choose(priority, prompt, tried)
        if replica is not None:
            self._take(replica, priority)
        return replica

    def release(self, replica: Replica, priority: int) -> None:
        replica.in_flight -= 1
        replica.by_priority[priority] -= 1
        if not replica.by_priority[priority]:
            del replica.by_priority[priority]
        self._running[replica.url] -= 1
        if not self._running[replica.url]:
            del self._running[replica.url]
        self.on_release(replica)

    def dispatch(self) -> None:
        """Hands free replicas to the queue, if anyone waits."""
        if self._waiting:
            self._dispatch()

    def _take(self, replica: Replica, priority: int) -> None:
        replica.in_flight += 1
        replica.by_priority[priority] += 1
        self._running[replica.url] += 1

    def _usable(self, priority: int, tried: frozenset[str]) -> tuple[Replica, ...]:
        now = time.monotonic()
        return tuple(
            r for r in self.replicas if self._has_room(r, priority) and not _passed_over(r, tried, now)
        )

    def _has_room(self, replica: Replica, priority: int) -> bool:
        cap = self.config.max_in_flight
        if self.config.replicas_preempt:
            return replica.in_flight_before(priority) < cap
        if is_background(priority) and holds_background(replica.by_priority):
            # The replica runs background requests only when no other is present: sent now, it would hold
            # this one in its own queue, where it would count against the cap and keep out urgent requests.
            return False
        return replica.in_flight < cap - _places_kept_for_more_urgent(
            priority - self._most_urgent_recent(), cap
        )

    def _most_urgent_recent(self) -> int:
        """The most urgent priority among this model's requests of the last URGENT_TIER_MEMORY_S."""
        since = time.monotonic() - URGENT_TIER_MEMORY_S
        return min((p for p, seen in self._last_seen.items() if seen >= since), default=PRIORITY_RANGE[1])

    def _choose(self, priority: int, prompt: Prompt, tried: frozenset[str]) -> Replica | None:
        now = time.monotonic()

        def usable(replica: Replica) -> bool:
            return self._has_room(replica, priority) and not _passed_over(replica, tried, now)

        if self.config.adapter_of is not None and self._running:
            bound = bounded_load(self.replicas, self.config.load_bound)

            def running_it(replica: Replica) -> bool:
                return usable(replica) and replica.url in self._running and replica.in_flight < bound

            replica = self.policy.choose(self.replicas, prompt, running_it)
            if replica is not None:
                return replica
        return self.policy.choose(self.replicas, prompt, usable)

    def _admit(self, waiter: _Waiter) -> None:
        """Queues the waiter, shedding the least urgent one queued if the queue is full."""
        if self._waiting >= self.max_queue:
            live = {str(queued.sequence): queued for queued in self._heap if not queued.future.done()}
            candidates = (QueuedRequest(key, w.priority, w.sequence) for key, w in live.items())
            victim_key = choose_victim(candidates, waiter.priority)
            if victim_key is None:
                self.metrics.rejected.labels(self.config.name, "queue_full", tier_of(waiter.priority)).inc()
                raise OverloadedError(
                    f"the queue of model {self.config.name!r} is full ({self.max_queue} requests), "
                    "none of them less urgent than this one",
                    code="queue_full",
                )
            victim = live[victim_key]
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
            replica = self._choose(waiter.priority, waiter.prompt, waiter.tried)
            if replica is None:
                if waiter.tried and self._usable(waiter.priority, frozenset()):
                    # Only replicas this request already failed on are free: the next waiter may take one.
                    parked.append(heapq.heappop(self._heap))
                    continue
                break
            heapq.heappop(self._heap)
            self._take(replica, waiter.priority)
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
        now = time.monotonic()
        if all(_passed_over(replica, tried, now) for replica in self.replicas):
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


def _passed_over(replica: Replica, tried: frozenset[str], now: float) -> bool:
    """Whether a request may not go to the replica whatever its load: it failed there already, or the replica
    is draining."""
    return replica.url in tried or replica.draining_until > now


def _prefill_config(config: ModelConfig) -> ModelConfig:
    """The settings of a model's prefill pool: its own, over the prefill replicas."""
    return dataclasses.replace(config, endpoints=config.prefill_endpoints, prefill_endpoints=())


class Fleet:
    """Every model's pool, kept in step with what discovery publishes and with the LoRA adapters each replica
    serves."""

    def __init__(
        self,
        max_queue: int,
        metrics: GatewayMetrics,
        bare_name_namespace: str | None = None,
        kv_index: KVBlockIndex | None = None,
    ) -> None:
        """`kv_index`: the replicas' cached blocks, which precise-prefix routes on."""
        self.max_queue = max_queue
        self.metrics = metrics
        self.bare_name_namespace = bare_name_namespace
        self.kv_index = kv_index if kv_index is not None else KVBlockIndex()
        self.pools: dict[str, ModelPool] = {}
        # The base models, as discovery published them, with the replicas woken since among their endpoints.
        self.models: dict[str, ModelConfig] = {}
        self._discovered: dict[str, ModelConfig] = {}
        # Replicas woken from sleep, by model: routed until discovery sees them ready (or no longer started);
        # and replicas that answered that they sleep, not routed while discovery still sees them ready.
        self._woken: dict[str, set[str]] = {}
        self._asleep: dict[str, set[str]] = {}
        # The adapters each replica serves, by URL, as last learnt.
        self._adapters: dict[str, AdapterIds] = {}
        self._replicas: dict[str, Replica] = {}

    def update(self, models: Mapping[str, ModelConfig]) -> None:
        self._discovered = dict(models)
        self._woken = {
            name: woken & set(models[name].sleeping_endpoints)
            for name, woken in self._woken.items()
            if name in models
        }
        self._asleep = {
            name: asleep & set(models[name].endpoints)
            for name, asleep in self._asleep.items()
            if name in models
        }
        self._apply()

    def woke(self, model: str, url: str) -> None:
        """A sleeping replica of the model answered its wake-up: it is routed at once, before the kubelet's
        next readiness probe finds it ready."""
        self._woken.setdefault(model, set()).add(url)
        self._asleep.get(model, set()).discard(url)
        self._apply()

    def fell_asleep(self, model: str, url: str) -> None:
        """A replica of the model answered that it sleeps (put to sleep since the kubelet's last probe): it
        is a sleeping replica, to wake, no longer an endpoint."""
        self._asleep.setdefault(model, set()).add(url)
        self._woken.get(model, set()).discard(url)
        self._apply()

    def update_adapters(self, adapters: Mapping[str, AdapterIds]) -> None:
        """The adapters of the replicas just asked, by URL; the others keep what was last learnt."""
        if any(self._adapters.get(url) != names for url, names in adapters.items()):
            self._adapters.update(adapters)
            self._apply()

    def resolve(self, model: str) -> ModelPool | None:
        """The pool of the model a request names. With a bare-name namespace, a name is first one of that
        namespace's (`llama-8b` for `NAMESPACE/llama-8b`, also when a served name holds a slash itself); any
        name is then looked up as given: `NAMESPACE/NAME`, or a --model name. Without one, bare names of
        InferenceServices are not routed: nothing else decides between namespaces serving the same name."""
        if self.bare_name_namespace is not None:
            pool = self.pools.get(qualified_name(self.bare_name_namespace, model))
            if pool is not None:
                return pool
        return self.pools.get(model)

    def replica_urls(self, policy: PolicyName | None = None) -> list[str]:
        """Every replica of a base model (routed by `policy`, when given), of either role."""
        return sorted(
            {
                url
                for config in self.models.values()
                if policy is None or config.policy == policy
                for url in config.endpoints + config.prefill_endpoints
            }
        )

    def routed_models(self) -> dict[str, ModelConfig]:
        """The base models and, under its own name, each adapter that some of a base model's replicas serve,
        routed to those replicas with its base model's settings, in its base model's namespace. A base model's
        name is never taken by an adapter, and an adapter that the replicas of several base models of one
        namespace serve goes with the first by name."""
        routed = dict(self.models)
        for base_name in sorted(self.models):
            base = self.models[base_name]
            holders = self._holders(base.endpoints)
            prefill_holders = self._holders(base.prefill_endpoints)
            for adapter, urls in sorted(holders.items()):
                name = qualified_name(base.namespace, adapter) if base.namespace else adapter
                if name not in routed:
                    routed[name] = dataclasses.replace(
                        base,
                        name=name,
                        served_name=adapter,
                        endpoints=tuple(urls),
                        # Only prefill replicas that serve the adapter compute its prompts: the KV of a prompt
                        # depends on its adapter.
                        prefill_endpoints=tuple(prefill_holders.get(adapter, ())),
                        adapter_of=base_name,
                    )
        return routed

    def _holders(self, urls: Iterable[str]) -> dict[str, list[str]]:
        """Of the replicas at `urls`, those serving each adapter, by adapter name."""
        holders: dict[str, list[str]] = {}
        for url in urls:
            for adapter in self._adapters.get(url, ()):
                holders.setdefault(adapter, []).append(url)
        return holders

    def _apply(self) -> None:
        self.models = {name: self._awake(config) for name, config in self._discovered.items()}
        models = self.routed_models()
        urls = set(self.replica_urls())
        self._adapters = {url: names for url, names in self._adapters.items() if url in urls}
        self._replicas = {url: replica for url, replica in self._replicas.items() if url in urls}
        for name in list(self.pools):
            if name not in models:
                self.pools.pop(name).close()
                self.metrics.forget(name)
        for name, config in models.items():
            pool = self.pools.get(name)
            if pool is None:
                pool = self.pools[name] = ModelPool(
                    config, self.max_queue, self.metrics, self._replica, self.kv_index
                )
                pool.on_release = self._released
                self.metrics.queue_depth.labels(name).set(0)
            elif pool.config != config:
                pool.reconfigure(config)
            self.metrics.ready_replicas.labels(name).set(len(config.endpoints))
        for url, replica in self._replicas.items():
            served = self._adapters.get(url, {})
            replica.lora_int_ids = {name: id_ for name, id_ in served.items() if id_ is not None}

    def _awake(self, config: ModelConfig) -> ModelConfig:
        """The model as discovered, with what its replicas said of their sleep since."""
        woken, asleep = self._woken.get(config.name, set()), self._asleep.get(config.name, set())
        if not woken and not asleep:
            return config
        return dataclasses.replace(
            config,
            endpoints=tuple(sorted({*config.endpoints, *woken} - asleep)),
            sleeping_endpoints=tuple(sorted({*config.sleeping_endpoints, *asleep} - woken)),
        )

    def _replica(self, url: str) -> Replica:
        replica = self._replicas.get(url)
        if replica is None:
            replica = self._replicas[url] = Replica(url)
        return replica

    def _released(self, replica: Replica) -> None:
        for pool in list(self.pools.values()):
            if replica in pool.replicas:
                pool.dispatch()
