"""The cohort model of a fleet: the trace's arrivals as cohorts, the replicas' engines as fluids, and the
gateway's and the operator's own code deciding, at a cost that does not grow with the requests.

Time goes in ticks. At each span's start the gateway cuts the span's arrivals into pieces (a bounded number
a span, about one a ready replica up to `pieces_per_span`) and the service's routing policy
(kvfleet.gateway.routing, the gateway's own classes) picks each piece's replica among those below their
in-flight cap, counting what it has sent a replica and not yet delivered as in flight there. Where the policy
does not read prompts, every piece carries an equal part of each cohort, as requests routed one by one
spread a span's mix of tenants over the replicas; where it does, a piece is of one cohort, whose prefix
decides. A piece's requests reach their replica spread over the ticks until the policy would come back to it
(one span, or longer where a span's pieces are fewer than the replicas), at the pace of the replica's share of
the arrivals: a replica given a second piece before the first is through takes longer over them, not the
two at once. What finds its replica at the cap goes to another below it within the tick, as the gateway
passes a full replica by; what finds none waits in the gateway's queue (held_cohorts: by tier, bounded in
length and time, shedding by the gateway's rule) and goes out by the policy, tick by tick, as places free.

Every metrics interval the ready replicas report to the operator's own `aggregate` and `decide`
(operator_loop), which set the replica count; a new replica is ready after the pod start delay, one chosen to
go takes nothing new, hands what the gateway had not yet delivered to it on to the others, and leaves when its
engine is empty. A request's time to first token is the time it waited in the gateway, the engine's
prediction when it arrives (fluid_engine) and the profile's first-token overhead; the report takes each
tick's latencies with the requests they stand for. Unlike the per-request model, the overhead holds no place
in the gateway: at the scale this model is for, a request's way in is a small part of the time it holds one.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy

from kvfleet.contract.tiers import TIER_NAMES
from kvfleet.gateway.routing import LeastRequest, Prompt, Replica, RoundRobin, make_policy
from kvfleet.simulate.cohorts import Cohort
from kvfleet.simulate.fleet import SimulationConfig, group_text
from kvfleet.simulate.fluid_engine import Arrivals, FluidEngines, compiled
from kvfleet.simulate.held_cohorts import HeldCohorts, HeldShare
from kvfleet.simulate.operator_loop import Operator, chosen_to_stop
from kvfleet.simulate.report import RunReport, bucket_indices


@dataclass(frozen=True)
class CohortOptions:
    # The cohorts' span: the gateway places a span's arrivals at its start.
    span_s: float = 0.5
    # The engines advance this long at a time (a whole number of ticks to a span).
    tick_s: float = 0.1
    # The most pieces the gateway cuts a span's cohorts into (at least one a cohort).
    pieces_per_span: int = 64


@dataclass(eq=False)
class _Route(Replica):
    """The gateway's view of a replica, with its engine's slot."""

    slot: int = 0


@dataclass(eq=False)
class _FluidReplica:
    route: _Route
    ready: bool = False
    ready_s: float = 0.0
    draining: bool = False
    # The prefix groups whose shared tokens its engine has computed.
    cached: set[str] | None = None


class _Streams:
    """What the gateway has placed on each replica and not yet delivered, per slot: requests by tier, their
    tokens to compute, whole prompts and outputs, and how many requests a tick it delivers."""

    def __init__(self) -> None:
        self.capacity = 0
        self.by_tier = numpy.zeros((len(TIER_NAMES), 0))
        # Work, prompt and output tokens, a row each: a tick delivers their shares in one operation.
        self.tokens = numpy.zeros((3, 0))
        self.pace = numpy.zeros(0)

    def fit(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        for name in ("by_tier", "tokens"):
            old = getattr(self, name)
            grown = numpy.zeros((old.shape[0], capacity))
            grown[:, : self.capacity] = old
            setattr(self, name, grown)
        pace = numpy.zeros(capacity)
        pace[: self.capacity] = self.pace
        self.pace = pace
        self.capacity = capacity

    def clear(self, slot: int) -> None:
        self.by_tier[:, slot] = 0.0
        self.tokens[:, slot] = 0.0
        self.pace[slot] = 0.0


class _Batch:
    """A span's pieces' additions to the streams, taken one piece at a time and applied together:
    numpy.add.at adds them in their order, to the same sums as one numpy scalar addition a piece, at a
    fraction of the cost."""

    def __init__(self) -> None:
        # (slot, tier index, requests, work, prompt and output tokens) a piece.
        self._pieces: list[tuple[int, int, float, float, float, float]] = []

    def add(self, slot: int, share: HeldShare, count: float, work: float) -> None:
        self._pieces.append(
            (slot, _TIER_INDEX[share.tier], count, work, share.prompt_tokens, share.output_tokens)
        )

    def to_streams(self, streams: _Streams) -> None:
        if self._pieces:
            pieces = numpy.array(self._pieces)
            slots, tiers = pieces[:, 0].astype(numpy.intp), pieces[:, 1].astype(numpy.intp)
            numpy.add.at(streams.by_tier.reshape(-1), tiers * streams.capacity + slots, pieces[:, 2])
            _add_rows(streams.tokens, slots, pieces[:, 3:])


class _Sends:
    """A tick's sends from the gateway's queue, added up per slot as they go: each slot's sums in the sends'
    order, as one scalar addition a send makes them, without a numpy operation a send."""

    def __init__(self, in_engine: numpy.ndarray) -> None:
        self._in_engine = in_engine
        # By slot sent to: the requests in its engine, then the arrivals' rows (the requests sent, their work,
        # prompt and output tokens).
        self._slots: dict[int, list[float]] = {}

    def in_engine(self, slot: int) -> float:
        sums = self._slots.get(slot)
        return float(self._in_engine[slot]) if sums is None else sums[0]

    def add(self, slot: int, share: HeldShare, count: float, work: float) -> float:
        """Counts `count` requests of the share sent to the slot; returns the requests in its engine now."""
        sums = self._slots.get(slot)
        if sums is None:
            sums = self._slots[slot] = [float(self._in_engine[slot]), 0.0, 0.0, 0.0, 0.0]
        sums[0] += count
        sums[1] += count
        sums[2] += work
        sums[3] += share.prompt_tokens
        sums[4] += share.output_tokens
        return sums[0]

    def to_arrivals(self, arrivals: Arrivals) -> None:
        """Adds the sends to the tick's arrivals and counts them in the engines' requests."""
        if self._slots:
            # The slots as an array, the sums as one flat run: numpy takes both several times faster than
            # lists.
            slots = numpy.fromiter(self._slots, numpy.intp, len(self._slots))
            sums = numpy.fromiter(itertools.chain.from_iterable(self._slots.values()), float)
            sums = sums.reshape(len(slots), -1)
            self._in_engine[slots] = sums[:, 0]
            arrivals.rows[:, slots] += sums[:, 1:].T


class _OpenRoutes:
    """The routes below their cap, as the set whose membership test the policy calls: every slot's route
    (the last replica's, once it has gone), routed or not, as the policy asks only about those it routes.

    Brought up to a tick's counts by the slots that crossed the cap since it last was (a few a tick, where
    making the set anew takes every route of the fleet)."""

    def __init__(self) -> None:
        self.routes: set[_Route] = set()
        # Each slot's route (None before any), and whether the set holds it.
        self._route_at = numpy.full(0, None, dtype=object)
        self._below = numpy.zeros(0, dtype=bool)

    def assign(self, slot: int, route: _Route, capacity: int) -> None:
        """The slot's route is now `route` (a new replica's); `capacity`: the slots there are."""
        if self._route_at.size < capacity:
            grown = numpy.full(capacity, None, dtype=object)
            grown[: self._route_at.size] = self._route_at
            self._route_at = grown
        if slot < self._below.size and self._below[slot]:
            self.routes.discard(self._route_at[slot])
            self.routes.add(route)
        self._route_at[slot] = route

    def update(self, below: numpy.ndarray) -> None:
        """Holds the routes of the slots `below` marks (those in use: they only grow)."""
        held = self._below
        if held.size < below.size:
            held = numpy.zeros(below.size, dtype=bool)
            held[: self._below.size] = self._below
        for slot in (below != held).nonzero()[0].tolist():
            if below[slot]:
                self.routes.add(self._route_at[slot])
            else:
                self.routes.discard(self._route_at[slot])
        self._below = below

    def close(self, route: _Route) -> None:
        """The route reached its cap."""
        self.routes.discard(route)
        self._below[route.slot] = False


class CohortSimulation:
    def __init__(self, config: SimulationConfig, options: CohortOptions = CohortOptions()) -> None:
        ticks = options.span_s / options.tick_s
        if ticks < 1 or abs(ticks - round(ticks)) > 1e-9:
            raise ValueError("a span must be a whole number of ticks")
        self.config = config
        self.options = options
        self._ticks_per_span = round(ticks)
        gateway = config.gateway
        self.policy = make_policy(gateway.policy, gateway.prefix_chars, gateway.load_bound)
        # The one prompt for every piece where the policy does not read prompts (a piece's own text costs
        # more to make than least-request takes to choose).
        self._blind_prompt = Prompt("") if isinstance(self.policy, (LeastRequest, RoundRobin)) else None
        self.cap = gateway.max_in_flight
        self.report = RunReport(config.ttft_target_s, config.spec.scaling.stable_window_seconds)
        self.operator = Operator(config.spec, self.report, config.initial_replicas)
        self.engines = FluidEngines(config.profile)
        self.held = HeldCohorts(config.max_queue, self.report)
        self._streams = _Streams()
        self._arrivals = Arrivals(0)
        self._replicas: dict[int, _FluidReplica] = {}
        # The gateway's view: the ready replicas that take requests, in a stable order.
        self._routed: list[_Route] = []
        self._starting: list[tuple[float, int, _FluidReplica]] = []
        self._names = itertools.count()
        self._pieces = itertools.count()
        self._group_text: dict[str, str] = {}
        self._now = 0.0
        self._in_engine = numpy.zeros(0)
        self._open = _OpenRoutes()
        # Whether the open routes were brought up to this tick's counts.
        self._open_now = False
        # Requests sent straight from the gateway's queue this tick: (slot, tier index, count, waited).
        self._sent: list[tuple[int, int, float, float]] = []
        self.peak_state_size = 0
        # First-token latencies by tier since the report last took them: requests by latency bucket, and
        # how many of them within the target.
        self._latencies = numpy.zeros((len(TIER_NAMES), _LATENCY_BUCKETS))
        self._within = numpy.zeros(len(TIER_NAMES))

    def run(self, cohorts: Iterable[list[Cohort]]) -> dict[str, Any]:
        """Replays the cohorts and runs on until every request is done; returns the report."""
        started = time.perf_counter()
        config, tick = self.config, self.options.tick_s
        for _ in range(self.operator.desired):
            self._start_replica(0.0)
        spans: Iterator[list[Cohort]] = iter(cohorts)
        upcoming = next(spans, None)
        interval = self.operator.policy.metrics_interval_seconds
        next_scrape, next_series, last_scrape = float(interval), config.series_interval_s, None
        for number in itertools.count():
            self._now = now = number * tick
            while now >= next_series - 1e-9:
                self._hand_latencies()
                self.report.close_interval(
                    next_series, self.operator.desired, len(self._routed), len(self._replicas)
                )
                next_series += config.series_interval_s
            self._become_ready()
            # What the gateway counts on a replica against its cap: places that free over the tick are free,
            # and what was sent it since the last tick (by a replica that went) is there.
            used = self.engines.used
            self._in_engine = (
                self.engines.in_engine() - self.engines.places_freeing() + self._arrivals.requests[:used]
            )
            self._open_now = False
            # What the gateway holds goes first, then what arrives.
            self._dispatch()
            if number % self._ticks_per_span == 0:
                span_end = now + self.options.span_s
                while upcoming is not None and upcoming[0].start_s < span_end - 1e-9:
                    self._place(upcoming)
                    upcoming = next(spans, None)
            self._tick()
            self.report.replica_seconds += len(self._replicas) * tick
            if now + tick >= next_scrape - 1e-9:
                self._now = next_scrape
                if upcoming is None and not self._in_flight():
                    break
                self._scrape(None if last_scrape is None else next_scrape - last_scrape)
                last_scrape, next_scrape = next_scrape, next_scrape + interval
        self._hand_latencies()
        self.report.close_interval(self._now, self.operator.desired, len(self._routed), len(self._replicas))
        extra = {"model": "cohort", "peak_state_size": self.peak_state_size}
        return self.report.summary(self._now, time.perf_counter() - started, extra)

    def _hand_latencies(self) -> None:
        for index in numpy.flatnonzero(self._latencies.sum(axis=1) > 0).tolist():
            self.report.first_tokens(TIER_NAMES[index], self._latencies[index], float(self._within[index]))
        self._latencies[:] = 0.0
        self._within[:] = 0.0

    # The gateway.

    def _place(self, cohorts: list[Cohort]) -> None:
        """Cuts the span's arrivals into pieces and places each by the routing policy."""
        for cohort in cohorts:
            self.report.arrived(cohort.tier, cohort.count)
        stream_ticks = self._ticks_per_span * max(1.0, len(self._routed) / self.options.pieces_per_span)
        self._refresh_in_flight()
        batch, paces = _Batch(), {}
        mixed = self._blind_prompt is not None
        for route, shares in self._mixed_pieces(cohorts) if mixed else self._cohort_pieces(cohorts):
            placed = 0.0
            for share, work in shares:
                batch.add(route.slot, share, share.count, work)
                # The gateway counts it in flight there from now on (as it does what it has sent).
                route.in_flight += share.count  # type: ignore[assignment]
                placed += share.count
            # Its stream's pace is its share of the arrivals: a piece still on its way there lengthens it.
            paces[route.slot] = paces.get(route.slot, 0.0) + placed / stream_ticks
        batch.to_streams(self._streams)
        pace = self._streams.pace
        for slot, value in paces.items():
            pace[slot] = value

    def _mixed_pieces(self, cohorts: list[Cohort]) -> Iterator[tuple[_Route, list[tuple[HeldShare, float]]]]:
        """Pieces that each carry an equal part of every cohort, as a policy that does not read prompts
        spreads a span's mix of tiers over the replicas it picks; with their work at the replica chosen."""
        mix = _SpanMix(cohorts, self.config.shared_prefix_tokens)
        pieces = max(1, min(len(self._routed), self.options.pieces_per_span))
        for given in range(pieces):
            route = self._choose("")
            if route is None:
                for cohort in cohorts:
                    self.held.hold(_share_of(cohort, self._now, (pieces - given) / pieces))
                return
            replica = self._replicas[route.slot]
            assert replica.cached is not None
            yield route, mix.piece(1 / pieces, replica.cached, self._now)

    def _cohort_pieces(self, cohorts: list[Cohort]) -> Iterator[tuple[_Route, list[tuple[HeldShare, float]]]]:
        """Pieces of one cohort each, as a policy that reads prompts sends a prefix group's requests, with
        their work at the replica chosen."""
        total = sum(cohort.count for cohort in cohorts)
        pieces = max(len(cohorts), min(len(self._routed), self.options.pieces_per_span))
        for cohort in cohorts:
            share = _share_of(cohort, self._now)
            cut = max(1, round(pieces * cohort.count / total))
            for remaining in range(cut, 0, -1):
                piece = share.split(share.count / remaining) if remaining > 1 else share
                route = self._choose(piece.prefix_group)
                if route is None:
                    self.held.hold(share if remaining == 1 else self._rest(piece, share))
                    break
                yield route, [(piece, self._work(route, piece))]

    @staticmethod
    def _rest(piece: HeldShare, share: HeldShare) -> HeldShare:
        """The piece with what is left of its cohort, to hold."""
        piece.count += share.count
        piece.prompt_tokens += share.prompt_tokens
        piece.output_tokens += share.output_tokens
        return piece

    def _choose(self, prefix_group: str) -> _Route | None:
        prompt = self._blind_prompt or self._prompt(prefix_group)
        if not self._open_now:
            self._open.update(self._in_engine < self.cap)
            self._open_now = True
        # A replica is usable below its cap: the set's own membership test, which the policy's scan of
        # the whole fleet (least-request's, where neither replica drawn is usable) calls without Python.
        usable = self._open.routes.__contains__
        route = self.policy.choose(self._routed, prompt, usable)  # type: ignore[arg-type]
        return route  # type: ignore[return-value]

    def _prompt(self, prefix_group: str) -> Prompt:
        """A piece's prompt: its prefix group's shared start, then text of its own."""
        text = self._group_text.get(prefix_group)
        if text is None:
            text = self._group_text[prefix_group] = group_text(prefix_group, self.config)
        return Prompt(f"{text}<piece {next(self._pieces)}>")

    def _work(self, route: _Route, share: HeldShare) -> float:
        """The prompt tokens the replica computes for the share: its prefix group's shared start once."""
        group = share.prefix_group
        if share.work_tokens is not None:
            return share.work_tokens
        if not group:
            return share.prompt_tokens
        replica = self._replicas[route.slot]
        assert replica.cached is not None
        saved = min(self.config.shared_prefix_tokens, share.prompt_tokens / share.count - 1)
        first_misses = 0.0 if group in replica.cached else 1.0
        replica.cached.add(group)
        return share.prompt_tokens - saved * max(share.count - first_misses, 0.0)

    def _dispatch(self) -> None:
        """Sends what the gateway holds, most urgent and oldest first, to replicas with places free."""
        held = self.held
        if held.held < _HELD_AT_ALL:
            return
        held.expire(self._now, self.config.gateway.hold_seconds)
        sends = _Sends(self._in_engine)
        for _ in range(self.options.pieces_per_span):
            share = held.head()
            if share is None or not self._send(share, held.take, sends):
                break
        sends.to_arrivals(self._arrivals)

    def _send_on(self, tiers: numpy.ndarray, tokens: numpy.ndarray) -> None:
        """Sends requests that found their replica at its cap (or going) to others below it at once, as the
        gateway passes a full replica by; what finds none waits in the gateway's queue."""
        # The deliveries changed what the replicas hold.
        self._open_now = False
        sends = _Sends(self._in_engine)
        budget = self.options.pieces_per_span
        for share in _shares_of(tiers, tokens, self._now):
            while budget and share.count > _LEAST and self._send(share, HeldShare.split, sends):
                budget -= 1
            if share.count > _LEAST:
                self.held.hold(share)
        sends.to_arrivals(self._arrivals)

    def _send(self, share: HeldShare, take: Callable[[HeldShare, float], HeldShare], sends: _Sends) -> bool:
        """Sends as much of the share as the replica the policy picks has room for (`take` takes it off);
        False where no replica is below its cap."""
        route = self._choose(share.prefix_group)
        if route is None:
            return False
        slot = route.slot
        count = min(share.count, self.cap - sends.in_engine(slot))
        sent = take(share, count)
        if sends.add(slot, sent, count, self._work(route, sent)) >= self.cap:
            self._open.close(route)
        route.in_flight += count  # type: ignore[assignment]
        self._sent.append((slot, _TIER_INDEX[sent.tier], count, self._now - sent.queued_at))
        return True

    def _refresh_in_flight(self) -> None:
        """The gateway counts in flight on a replica what it holds and what is on its way to it (taken at
        each span's start, and counted up as the gateway sends more within it)."""
        in_flight = (self._in_engine + self._streams.by_tier[:, : self.engines.used].sum(axis=0)).tolist()
        for route in self._routed:
            route.in_flight = in_flight[route.slot]  # type: ignore[assignment]

    # The replicas.

    def _tick(self) -> None:
        """Delivers the streams' share of the tick (what finds the cap goes back to the gateway) and runs
        the engines."""
        used, streams, arrivals = self.engines.used, self._streams, self._arrivals
        delivered, turned_back, turned_back_tokens = _deliver(
            streams.by_tier, streams.tokens, streams.pace, self._in_engine, self.cap, arrivals.rows, used
        )
        if turned_back.sum() > _LEAST:
            self._send_on(turned_back, turned_back_tokens)
        # A first token's overhead counts the sequences of the step that computes it, itself aside.
        profile = self.config.profile
        running = numpy.minimum(self.engines.in_engine() + arrivals.requests[:used], profile.max_num_seqs)
        overhead = profile.first_token_overhead(numpy.maximum(running - 1.0, 0.0))
        latencies = self.engines.advance(self.options.tick_s, arrivals)
        active = numpy.flatnonzero(delivered.sum(axis=1) > _LEAST)
        if active.size:
            seconds = numpy.concatenate((latencies.at_once_s + overhead, latencies.waiting_s + overhead))
            _count_first_tokens(
                self._latencies,
                self._within,
                active,
                delivered,
                latencies.at_once,
                arrivals.requests,
                *self._bucketed(seconds),
            )
        if self._sent:
            slots, tiers, counts, waited = numpy.array(self._sent).T
            slots, tiers = slots.astype(numpy.intp), tiers.astype(numpy.intp)
            buckets, within_target = self._bucketed(waited + latencies.mean_s()[slots] + overhead[slots])
            numpy.add.at(self._latencies, (tiers, buckets), counts)
            numpy.add.at(self._within, tiers, counts * within_target)
            self._sent = []
        arrivals.rows[:, :used] = 0.0
        self.peak_state_size = max(self.peak_state_size, self._state_size())

    def _bucketed(self, seconds: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """First-token latencies' buckets in the counts kept, and whether each is within the target."""
        buckets = numpy.minimum(bucket_indices(seconds), _LATENCY_BUCKETS - 1)
        return buckets, seconds <= self.config.ttft_target_s

    def _start_replica(self, ready_at: float) -> None:
        slot = self.engines.add()
        self._streams.fit(self.engines.capacity)
        if self._arrivals.requests.size < self.engines.capacity:
            self._arrivals = Arrivals(self.engines.capacity)
        replica = _FluidReplica(_Route(f"http://replica-{next(self._names)}:8000", slot=slot), cached=set())
        self._replicas[slot] = replica
        self._open.assign(slot, replica.route, self.engines.capacity)
        heapq.heappush(self._starting, (ready_at, slot, replica))

    def _become_ready(self) -> None:
        while self._starting and self._starting[0][0] <= self._now + 1e-9:
            _, _, replica = heapq.heappop(self._starting)
            if replica.draining:
                continue
            replica.ready, replica.ready_s = True, self._now
            self._routed.append(replica.route)

    def _in_flight(self) -> bool:
        used = self.engines.used
        return bool(
            self.held.held > 1e-9
            or self.engines.in_engine().sum() > 1e-6
            or self._streams.by_tier[:, :used].sum() > 1e-6
        )

    # The operator.

    def _scrape(self, interval_s: float | None) -> None:
        ready = [r for r in self._replicas.values() if r.ready and not r.draining]
        reports = self.engines.report([r.route.slot for r in ready], interval_s)
        desired = self.operator.desired
        wanted = self.operator.scrape(self._now, list(reports), self.held.held)
        if wanted != desired:
            self._resize(wanted)
        self._retire_drained()

    def _resize(self, wanted: int) -> None:
        staying = [r for r in self._replicas.values() if not r.draining]
        for _ in range(wanted - len(staying)):
            self._start_replica(self._now + self.config.pod_start_s)
        for replica in chosen_to_stop(staying, len(staying) - wanted):
            replica.draining = True
            if replica.ready:
                self._routed.remove(replica.route)
            self._hand_back(replica.route.slot)

    def _hand_back(self, slot: int) -> None:
        """What the gateway had placed on a replica that goes and not yet delivered goes to other replicas."""
        streams = self._streams
        tiers = streams.by_tier[:, slot : slot + 1].copy()
        if tiers.sum() > 1e-9:
            self._send_on(tiers, streams.tokens[:, slot : slot + 1].copy())
        streams.clear(slot)

    def _retire_drained(self) -> None:
        in_engine = self.engines.in_engine()
        for slot, replica in list(self._replicas.items()):
            if replica.draining and in_engine[slot] <= 1e-6:
                del self._replicas[slot]
                self.engines.remove(slot)
                self._streams.clear(slot)

    def _state_size(self) -> int:
        """What the model holds: its replicas' slots and the shares the gateway holds."""
        return self.engines.capacity + len(self.held)


# Fewer requests than this are none (what rounding leaves of a share).
_LEAST = 1e-6
# A stream's or an engine's amount below this is nothing to take a share of.
_NONE = 1e-12
# The gateway sends what it holds from this much on (less is the dust of shares cut by rounding).
_HELD_AT_ALL = 1e-3
# Latency buckets kept (1% apart from 0.1 ms: the last starts at about 19 hours).
_LATENCY_BUCKETS = 2048
_TIER_INDEX = {tier: index for index, tier in enumerate(TIER_NAMES)}


def _share_of(cohort: Cohort, now: float, part: float = 1.0) -> HeldShare:
    """A part of the cohort's requests as a share, with its tokens' part."""
    return HeldShare(
        cohort.tier,
        cohort.prefix_group,
        cohort.count * part,
        cohort.prompt_tokens * part,
        cohort.output_tokens * part,
        now,
    )


class _SpanMix:
    """A span's arrivals added up by tier, with the prompt tokens each prefix group's requests share: the
    pieces of a mixed span take an equal part of every cohort."""

    def __init__(self, cohorts: list[Cohort], shared_prefix_tokens: int) -> None:
        # By tier: requests, prompt and output tokens, and the prompt tokens to compute on a replica that
        # has every group's prefix.
        self._tiers: dict[str, list[float]] = {}
        # By prefix group: its tier, requests, and the tokens a request finds cached.
        self._groups: dict[str, tuple[str, float, float]] = {}
        for cohort in cohorts:
            sums = self._tiers.setdefault(cohort.tier, [0.0, 0.0, 0.0, 0.0])
            saved = 0.0
            if cohort.prefix_group:
                saved = min(shared_prefix_tokens, cohort.prompt_tokens / cohort.count - 1)
                self._groups[cohort.prefix_group] = (cohort.tier, cohort.count, saved)
            sums[0] += cohort.count
            sums[1] += cohort.prompt_tokens
            sums[2] += cohort.output_tokens
            sums[3] += cohort.prompt_tokens - saved * cohort.count
        self._names = set(self._groups)

    def piece(self, part: float, cached: set[str], now: float) -> list[tuple[HeldShare, float]]:
        """`part` of every cohort, a share a tier with its work on a replica with the prefixes `cached`
        (those of the span are cached there after it)."""
        missed = dict.fromkeys(self._tiers, 0.0)
        for group in self._names - cached:
            tier, count, saved = self._groups[group]
            # The group's first request there computes the prefix its others then find.
            missed[tier] += saved * min(1.0, part * count)
        cached |= self._names
        return [
            (HeldShare(tier, "", part * count, part * prompt, part * output, now), part * work + missed[tier])
            for tier, (count, prompt, output, work) in self._tiers.items()
        ]


def _shares_of(tiers: numpy.ndarray, tokens: numpy.ndarray, now: float) -> Iterator[HeldShare]:
    """Requests by tier and slot as one share a tier (their tokens, rows of work, prompt and output, as
    computed where they were bound: their prefix is not carried), each tier's share of the tokens of all."""
    work, prompt, output = (row.sum() for row in tokens)
    counts = tiers.sum(axis=1)
    total = counts.sum()
    for index in numpy.flatnonzero(counts > 1e-9).tolist():
        part = counts[index] / total
        yield HeldShare(
            TIER_NAMES[index],
            "",
            float(counts[index]),
            float(prompt * part),
            float(output * part),
            now,
            float(work * part),
        )


def _add_rows(rows: numpy.ndarray, slots: numpy.ndarray, values: numpy.ndarray) -> None:
    """Adds column i of `values` (a row a piece) to row i of `rows` at the pieces' slots, each element's
    additions in the pieces' order (a row at a time: numpy.add.at is slower on two dimensions)."""
    for row, column in zip(rows, values.T, strict=True):
        numpy.add.at(row, slots, column)


@compiled
def _deliver(
    by_tier: numpy.ndarray,
    tokens: numpy.ndarray,
    pace: numpy.ndarray,
    in_engine: numpy.ndarray,
    cap: float,
    arrivals: numpy.ndarray,
    used: int,
) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """Takes each stream's share of the tick (its pace, of what it holds) and delivers it to the engine's
    arrivals up to the cap, counting it in the engine's requests. Returns per slot the requests delivered by
    tier, and those that found the cap by tier with their tokens (work, prompt, output), for the gateway to
    send on."""
    tiers, rows = by_tier.shape[0], tokens.shape[0]
    delivered = numpy.zeros((tiers, used))
    turned_back, turned_back_tokens = numpy.zeros((tiers, used)), numpy.zeros((rows, used))
    for slot in range(used):
        pending = 0.0
        for tier in range(tiers):
            pending += by_tier[tier, slot]
        due = min(pending, pace[slot])
        arrived = min(due, max(cap - in_engine[slot], 0.0))
        in_engine[slot] += arrived
        taken = due / pending if pending > _NONE else 0.0
        kept = arrived / due if due > _NONE else 0.0
        arrivals[0, slot] += arrived
        for tier in range(tiers):
            tier_due = by_tier[tier, slot] * taken
            by_tier[tier, slot] -= tier_due
            delivered[tier, slot] = tier_due * kept
            turned_back[tier, slot] = tier_due * (1 - kept)
        for row in range(rows):
            moved = tokens[row, slot] * taken
            tokens[row, slot] -= moved
            arrivals[1 + row, slot] += moved * kept
            turned_back_tokens[row, slot] = moved * (1 - kept)
    return delivered, turned_back, turned_back_tokens


@compiled
def _count_first_tokens(
    latencies: numpy.ndarray,
    within: numpy.ndarray,
    active: numpy.ndarray,
    delivered: numpy.ndarray,
    at_once: numpy.ndarray,
    came: numpy.ndarray,
    buckets: numpy.ndarray,
    within_target: numpy.ndarray,
) -> None:
    """Counts the tick's first tokens of the tiers `active` names by latency bucket, and those within the
    target: a slot's requests delivered of a tier, split as its engine's arrivals were between a place at
    once and a wait (`buckets` and `within_target` hold each slot's place at once, then each slot's wait)."""
    slots = delivered.shape[1]
    for slot in range(slots):
        share = at_once[slot] / came[slot] if came[slot] > _NONE else 0.0
        for tier in active:
            count = delivered[tier, slot]
            at_once_part, waiting_part = count * share, count * (1 - share)
            latencies[tier, buckets[slot]] += at_once_part
            latencies[tier, buckets[slots + slot]] += waiting_part
            within[tier] += at_once_part * within_target[slot] + waiting_part * within_target[slots + slot]
