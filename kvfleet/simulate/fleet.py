"""The fleet simulation: a discrete-event loop over a trace, with the gateway's routing policies and the
operator's autoscaler deciding as they do in the cluster.

Events are kept in one heap by time. At equal times a step that ends goes first, then a replica that becomes
ready, then an arrival, then a request that reaches its replica's engine, then the operator's scrape, so that
a scrape sees every request that arrived by then and an arrival sees every replica that is ready by then. Each
replica's step is one event (never one per token), and the trace is read one request ahead, so memory follows
the requests in flight.

The gateway: a request goes to the replica the service's routing policy picks (kvfleet.gateway.routing, the
gateway's own classes, with the load bound) among the ready replicas below their in-flight cap; when there is
none, it waits in a queue ordered by tier, then arrival, bounded in length and in time as the gateway's is (a
full queue sheds by kvfleet.contract.precedence, the gateway's rule). A routed request reaches its replica's
engine the profile's first-token overhead later (its way in through the servers, and its tokens' way out,
which the model puts ahead of the engine): a place in the gateway is held for that overhead and the engine's
time, as a real one is held from the moment the request is sent until its stream has been relayed.

The operator: every metrics interval the ready replicas report (PodMetrics, as scraped from /metrics) and the
operator's own `aggregate` and `decide` (kvfleet.operator.autoscaler, through operator_loop) set the replica
count, on the service's spec. A new replica is ready after the pod start delay. One chosen to go stops
receiving requests at once and leaves when its last request finishes (a drain-safe scale-down); until then
it counts as running.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from kvfleet.contract.precedence import QueuedRequest, choose_victim
from kvfleet.contract.tiers import TIERS
from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.flow import DEFAULT_MAX_QUEUE
from kvfleet.gateway.kube import model_configs
from kvfleet.gateway.routing import CHARS_PER_TOKEN, Prompt, Replica, make_policy
from kvfleet.operator.autoscaler import PodMetrics
from kvfleet.operator.spec import InferenceServiceSpec, parse_spec
from kvfleet.simulate.engine import EngineModel, EngineProfile, Sequence
from kvfleet.simulate.operator_loop import Operator, chosen_to_stop
from kvfleet.simulate.report import RunReport
from kvfleet.simulate.trace import TraceRequest

# Event kinds, in the order they run at equal times.
STEP_END, REPLICA_READY, ARRIVAL, REACHED_ENGINE, SCRAPE = range(5)
SERVICE = "sim"


@dataclass(frozen=True)
class SimulationConfig:
    spec: InferenceServiceSpec
    profile: EngineProfile
    # How the gateway routes the service (from the spec, as the gateway reads it: gateway_config()).
    gateway: ModelConfig
    ttft_target_s: float
    pod_start_s: float = 60.0
    # Tokens a prefix group's requests share (at most each prompt).
    shared_prefix_tokens: int = 256
    max_queue: int = DEFAULT_MAX_QUEUE
    series_interval_s: float = 60.0
    # Replicas at the start (within the spec's bounds); None: the minimum, and at least one.
    initial_replicas: int | None = None


def gateway_config(service: dict[str, Any]) -> ModelConfig:
    """The routing settings the gateway derives from an InferenceService (its `spec`), with no replicas."""
    resource = {"metadata": {"name": SERVICE, "namespace": SERVICE}, "spec": service}
    return next(iter(model_configs([resource], [], ModelConfig(name="", endpoints=())).values()))


def load_config(service: dict[str, Any], profile: EngineProfile, **options: Any) -> SimulationConfig:
    """A simulation of the InferenceService `spec`; the engine's limits come from its engine section."""
    spec = parse_spec(service, name=SERVICE)
    if spec.disaggregation is not None:
        raise ValueError("the simulator models colocated replicas: spec.disaggregation is not simulated")
    if spec.engine.max_num_seqs:
        profile = replace(profile, max_num_seqs=spec.engine.max_num_seqs)
    target = options.pop("ttft_target_s", None)
    if target is None:
        if spec.sla.ttft_target_milliseconds is None:
            raise ValueError("a TTFT target is needed: spec.sla.ttftTargetMilliseconds or --ttft-target-ms")
        target = spec.sla.ttft_target_milliseconds / 1000
    return SimulationConfig(spec, profile, gateway_config(service), target, **options)


def group_text(prefix_group: str, config: SimulationConfig) -> str:
    """Text standing for the start a prefix group's prompts share, as long as its shared tokens."""
    seed = f"[{prefix_group}]"
    length = config.shared_prefix_tokens * CHARS_PER_TOKEN
    return (seed * (length // len(seed) + 1))[:length]


@dataclass(eq=False)
class _Request:
    trace: TraceRequest
    priority: int
    sequence_number: int
    prompt_text: str
    replica: Replica | None = None


@dataclass(eq=False)
class _SimReplica:
    """A replica: its engine, its place in the gateway, and its life."""

    route: Replica
    engine: EngineModel
    ready: bool = False
    # When it became ready.
    ready_s: float = 0.0
    draining: bool = False
    gone: bool = False
    in_step: bool = False
    # Numbers the replica's step events: a run of decode steps cut short leaves an event that must not count.
    step_version: int = 0


class Simulation:
    def __init__(self, config: SimulationConfig) -> None:
        self.config = config
        self.spec = config.spec
        gateway = config.gateway
        self.policy = make_policy(gateway.policy, gateway.prefix_chars, gateway.load_bound)
        self.cap = gateway.max_in_flight
        self.report = RunReport(config.ttft_target_s, config.spec.scaling.stable_window_seconds)
        self.operator = Operator(config.spec, self.report, config.initial_replicas)
        self._events: list[tuple[float, int, int, Any]] = []
        self._order = itertools.count()
        self._names = itertools.count()
        self._replicas: dict[str, _SimReplica] = {}
        # The gateway's view: the ready replicas that take requests, in a stable order.
        self._routed: list[Replica] = []
        # The gateway's queue for the service: by priority, (number, queued at, request) in arrival order.
        self._queue: dict[int, deque[tuple[int, float, _Request]]] = {}
        self._queued = 0
        self._arrivals = itertools.count()
        self._now = 0.0
        self._counted_at = 0.0
        self._group_text: dict[str, str] = {}
        self._in_flight = 0
        self.peak_in_flight = 0
        # Counts of the engines of replicas that are gone, and at the end of all of them.
        self._engines: Counter[str] = Counter()

    def run(self, trace: Iterable[TraceRequest]) -> dict[str, Any]:
        """Replays the trace and runs on until every request is done; returns the report."""
        started = time.perf_counter()
        for _ in range(self.operator.desired):
            self._start_replica(ready_at=0.0)
        requests = iter(trace)
        self._next_arrival(requests)
        self._push(self.operator.policy.metrics_interval_seconds, SCRAPE, None)
        next_series = self.config.series_interval_s
        while self._events:
            at, kind, _, payload = heapq.heappop(self._events)
            while at >= next_series:
                self._close_interval(next_series)
                next_series += self.config.series_interval_s
            self._advance(at)
            if kind == STEP_END:
                self._step_ended(*payload)
            elif kind == REPLICA_READY:
                self._replica_ready(payload)
            elif kind == ARRIVAL:
                self._arrive(payload)
                self._next_arrival(requests)
            elif kind == REACHED_ENGINE:
                self._reach_engine(*payload)
            elif self._pending_work():
                self._scrape()
        self._close_interval(self._now)
        for replica in self._replicas.values():
            self._count_engine(replica.engine)
        extra = {
            "preemptions": self._engines["preemptions"],
            "prefix_cache_hit_rate": self._engines["prefix_hits"] / max(self._engines["admitted"], 1),
            "peak_requests_in_flight": self.peak_in_flight,
        }
        return self.report.summary(self._now, time.perf_counter() - started, extra)

    # The event loop.

    def _push(self, at: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (at, kind, next(self._order), payload))

    def _advance(self, at: float) -> None:
        """Moves the clock, counting the replicas that cost money meanwhile."""
        self.report.replica_seconds += len(self._replicas) * (at - self._counted_at)
        self._counted_at = self._now = at

    def _pending_work(self) -> bool:
        """Whether the scrape has anything left to decide on: otherwise the run is over."""
        self._push(self._now + self.operator.policy.metrics_interval_seconds, SCRAPE, None)
        if any(kind != SCRAPE for _, kind, _, _ in self._events) or self._in_flight:
            return True
        self._events.clear()
        return False

    def _close_interval(self, at: float) -> None:
        self.report.close_interval(at, self.operator.desired, len(self._routed), len(self._replicas))

    def _next_arrival(self, requests: Iterator[TraceRequest]) -> None:
        request = next(requests, None)
        if request is not None:
            self._push(request.arrival_s, ARRIVAL, request)

    # The gateway.

    def _arrive(self, trace: TraceRequest) -> None:
        self.report.arrived(trace.tier)
        number = next(self._arrivals)
        request = _Request(trace, TIERS[trace.tier], number, self._prompt_text(trace, number))
        self._in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        if not self._queued and self._route(request):
            return
        self._enqueue(request)

    def _prompt_text(self, trace: TraceRequest, number: int) -> str:
        """Text standing for the prompt: its group's shared start, then something of its own."""
        shared = min(self.config.shared_prefix_tokens, trace.prompt_tokens) if trace.prefix_group else 0
        text = self._group_text.get(trace.prefix_group)
        if text is None:
            text = self._group_text[trace.prefix_group] = group_text(trace.prefix_group, self.config)
        return text[: shared * CHARS_PER_TOKEN] + f"<request {number}>".ljust(16 * CHARS_PER_TOKEN, ".")

    def _route(self, request: _Request) -> bool:
        cap = self.cap
        replica = self.policy.choose(self._routed, Prompt(request.prompt_text), lambda r: r.in_flight < cap)
        if replica is None:
            return False
        # The requests the replica holds (running, queued in its engine, or on their way) beside this one.
        overhead = self.config.profile.first_token_overhead(replica.in_flight)
        replica.in_flight += 1
        request.replica = replica
        trace = request.trace
        shared = min(self.config.shared_prefix_tokens, trace.prompt_tokens) if trace.prefix_group else 0
        sequence = Sequence(
            trace.prompt_tokens, trace.output_tokens, trace.prefix_group, shared, self._now, owner=request
        )
        simulated = self._replicas[replica.url]
        if overhead > 0:
            self._push(self._now + overhead, REACHED_ENGINE, (simulated, sequence))
        else:
            self._reach_engine(simulated, sequence)
        return True

    def _enqueue(self, request: _Request) -> None:
        """Queues the request; a full queue sheds its newest of the least urgent tier the newcomer displaces,
        or the newcomer. Only the newest of each tier can be that one, so only those are offered."""
        if self._queued >= self.config.max_queue:
            newest = (
                QueuedRequest(str(priority), priority, queue[-1][1])
                for priority, queue in self._queue.items()
                if queue
            )
            victim = choose_victim(newest, request.priority)
            if victim is None:
                self._shed(request)
                return
            self._shed(self._queue[int(victim)].pop()[2])
            self._queued -= 1
        queue = self._queue.setdefault(request.priority, deque())
        queue.append((request.sequence_number, self._now, request))
        self._queued += 1
        self.report.waited(request.trace.tier)

    def _shed(self, request: _Request) -> None:
        self.report.shed(request.trace.tier)
        self._in_flight -= 1

    def _dispatch(self) -> None:
        """Hands free places to the queue's head, in tier and arrival order; drops those held too long."""
        hold = self.config.gateway.hold_seconds
        while self._queued:
            queue = self._queue[min(priority for priority, queue in self._queue.items() if queue)]
            _, queued_at, request = queue[0]
            if self._now - queued_at > hold:
                queue.popleft()
                self._queued -= 1
                self._shed(request)
                continue
            if not self._route(request):
                return
            queue.popleft()
            self._queued -= 1

    # The replicas.

    def _reach_engine(self, simulated: _SimReplica, sequence: Sequence) -> None:
        simulated.engine.add(sequence)
        if not simulated.in_step:
            self._start_step(simulated)
        else:
            ends = simulated.engine.interrupt(self._now)
            if ends is not None:
                simulated.step_version += 1
                self._push(ends, STEP_END, (simulated, simulated.step_version))

    def _start_step(self, replica: _SimReplica) -> None:
        length = replica.engine.start_step(self._now)
        replica.in_step = length is not None
        if length is not None:
            replica.step_version += 1
            self._push(self._now + length, STEP_END, (replica, replica.step_version))

    def _step_ended(self, replica: _SimReplica, version: int) -> None:
        if version != replica.step_version:
            return  # the step was cut short by an arrival, and ended earlier
        outcome = replica.engine.finish_step(self._now)
        for sequence in outcome.first_tokens:
            request: _Request = sequence.owner  # type: ignore[assignment]
            self.report.first_token(request.trace.tier, self._now - request.trace.arrival_s)
        replica.route.in_flight -= len(outcome.finished)
        self._in_flight -= len(outcome.finished)
        self._start_step(replica)
        if outcome.finished:
            if replica.draining and not replica.route.in_flight:
                self._retire(replica)
            else:
                self._dispatch()

    def _start_replica(self, ready_at: float) -> None:
        url = f"http://replica-{next(self._names)}:8000"
        self._replicas[url] = _SimReplica(Replica(url), EngineModel(self.config.profile))
        self._push(ready_at, REPLICA_READY, self._replicas[url])

    def _replica_ready(self, replica: _SimReplica) -> None:
        if replica.gone:
            return
        replica.ready, replica.ready_s = True, self._now
        self._routed.append(replica.route)
        self._dispatch()

    # The operator.

    def _scrape(self) -> None:
        self._dispatch()
        ready = [r for r in self._replicas.values() if r.ready and not r.draining]
        reports: list[PodMetrics | None] = [replica.engine.report(self._now) for replica in ready]
        desired = self.operator.desired
        wanted = self.operator.scrape(self._now, reports, float(self._queued))
        if wanted != desired:
            self._resize(wanted)

    def _resize(self, wanted: int) -> None:
        """Starts replicas, or drains the ones to go, as a ReplicaSet chooses them (the operator leaves it the
        choice): those still starting first, then the most recently ready."""
        staying = [r for r in self._replicas.values() if not r.draining]
        for _ in range(wanted - len(staying)):
            self._start_replica(self._now + self.config.pod_start_s)
        for replica in chosen_to_stop(staying, len(staying) - wanted):
            replica.draining = True
            if replica.ready:
                self._routed.remove(replica.route)
            if not replica.route.in_flight:
                self._retire(replica)

    def _retire(self, replica: _SimReplica) -> None:
        """A drained replica leaves: it stops costing, and its engine's counts join the run's."""
        replica.gone = True
        del self._replicas[replica.route.url]
        self._count_engine(replica.engine)

    def _count_engine(self, engine: EngineModel) -> None:
        self._engines.update(
            preemptions=engine.preemptions, prefix_hits=engine.prefix_hits, admitted=engine.admitted
        )
