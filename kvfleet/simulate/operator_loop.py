"""The operator in a simulated fleet, whichever model the replicas are: every metrics interval the ready
replicas' reports go through the operator's own `aggregate` into the stable window's samples, and its own
`decide` sets the replica count, as kvfleet.operator does for a Deployment. Which replicas a scale-down
stops is the ReplicaSet's choice (the operator sets no deletion cost): any still starting, then the most
recently ready."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvfleet.operator.autoscaler import (
    AutoscalerState,
    FleetState,
    MetricsSample,
    PodMetrics,
    Waits,
    aggregate,
    decide,
    sizing,
)
from kvfleet.operator.spec import InferenceServiceSpec
from kvfleet.simulate.report import RunReport, ScaleEvent


class Operator:
    """The autoscaler's state across decisions, and the count it last asked for."""

    def __init__(self, spec: InferenceServiceSpec, report: RunReport, initial_replicas: int | None) -> None:
        self.fit = sizing(spec)
        self.policy = self.fit.policy
        self.report = report
        # As the operator starts a service: with a replica even when it may scale to zero.
        wanted = initial_replicas if initial_replicas is not None else max(self.policy.min_replicas, 1)
        self.desired = self.policy.clamp(wanted)
        self._samples: list[MetricsSample] = []
        self._state = AutoscalerState()
        # The gateway's counts of the requests that reached it, that it refused and that waited in its queue,
        # at the last scrape.
        self._counted = (0.0, 0.0, 0.0)

    def scrape(self, now: float, reports: Sequence[PodMetrics | None], held: float) -> int:
        """Decides on the ready replicas' reports and the requests the gateway holds; returns the count
        wanted now (a change is logged as a scale event)."""
        policy = self.policy
        counts, before = self.report.gateway_counts(), self._counted
        self._counted = counts
        arrived, refused, waited = (count - earlier for count, earlier in zip(counts, before, strict=True))
        refused_share = refused / arrived if arrived > 0 else 0.0
        sample = aggregate(now, reports, len(reports), held, refused_share, Waits(arrived, waited))
        if sample is None and not reports and policy.min_replicas == 0:
            sample = MetricsSample(time=now, queue_depth=held, reporting_pods=0, held=held)
        if sample is not None:
            self._samples.append(sample)
        self._samples = [s for s in self._samples if now - s.time < policy.stable_window_seconds]
        fit = self.fit
        fleet = FleetState(self.desired, len(reports))
        decision = decide(policy, self._samples, fleet, self._state, now, fit.latency, fit.targets, fit.slo)
        self._state = decision.state
        if decision.replicas != self.desired:
            self.report.scaled(ScaleEvent(now, self.desired, decision.replicas, decision.reason))
            self.desired = decision.replicas
        return self.desired


class Stoppable(Protocol):
    ready: bool
    # When it became ready.
    ready_s: float


StoppableT = TypeVar("StoppableT", bound=Stoppable)


def chosen_to_stop(staying: Sequence[StoppableT], excess: int) -> list[StoppableT]:
    """The `excess` replicas a ReplicaSet stops: those still starting first, then the most recently ready."""
    return sorted(staying, key=lambda replica: (replica.ready, -replica.ready_s))[: max(excess, 0)]
