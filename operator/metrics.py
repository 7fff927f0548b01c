"""The operator's own Prometheus metrics: reconciles, errors, durations, API calls, replicas per service."""

from __future__ import annotations

import contextlib
import functools

from kvfleet.operator.dispatch import PriorityDispatcher, Urgency
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SERVICE = ("namespace", "name")


class OperatorMetrics:
    """One registry per operator, so tests and embedded runs do not share global state."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "kvfleet_operator_reconciles", "Reconcile passes, by result.", ["result"], registry=self.registry
        )
        self.reconcile_errors = Counter(
            "kvfleet_operator_reconcile_errors",
            "Reconcile passes that failed, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "kvfleet_operator_reconcile_duration_seconds",
            "Time of one reconcile pass (render, apply, scrape, status).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.applies = Counter(
            "kvfleet_operator_applies", "Server-side applies, by kind.", ["kind"], registry=self.registry
        )
        self.desired_replicas = Gauge(
            "kvfleet_operator_desired_replicas", "Replicas asked for.", _SERVICE, registry=self.registry
        )
        self.ready_replicas = Gauge(
            "kvfleet_operator_ready_replicas", "Replicas that are ready.", _SERVICE, registry=self.registry
        )
        self.queue_depth = Gauge(
            "kvfleet_operator_queue_depth",
            "Requests running plus waiting across a service's replicas, as last scraped.",
            _SERVICE,
            registry=self.registry,
        )
        self.scale_events = Counter(
            "kvfleet_operator_scale_events",
            "Replica count changes the autoscaler made, by direction.",
            [*_SERVICE, "direction"],
            registry=self.registry,
        )
        self.scrape_failures = Counter(
            "kvfleet_operator_scrape_failures",
            "Replicas that did not answer a metrics scrape.",
            _SERVICE,
            registry=self.registry,
        )
        self.scrape_pages_too_large = Counter(
            "kvfleet_operator_scrape_pages_too_large",
            "Replicas whose metrics page passed the operator's byte cap (also counted as scrape failures).",
            _SERVICE,
            registry=self.registry,
        )
        self.api_calls_waiting = Gauge(
            "kvfleet_operator_api_calls_waiting",
            "The service loops' API calls waiting for their turn, by urgency.",
            ["urgency"],
            registry=self.registry,
        )
        self.api_calls_in_flight = Gauge(
            "kvfleet_operator_api_calls_in_flight",
            "The service loops' API calls sent and not yet answered, by urgency.",
            ["urgency"],
            registry=self.registry,
        )

    def watch_dispatcher(self, dispatcher: PriorityDispatcher) -> None:
        for urgency in Urgency:
            label = urgency.name.lower()
            self.api_calls_waiting.labels(label).set_function(functools.partial(dispatcher.waiting, urgency))
            self.api_calls_in_flight.labels(label).set_function(
                functools.partial(dispatcher.in_flight, urgency)
            )

    def forget(self, namespace: str, name: str) -> None:
        """Drops a deleted service's series."""
        per_service = (
            self.desired_replicas,
            self.ready_replicas,
            self.queue_depth,
            self.scrape_failures,
            self.scrape_pages_too_large,
        )
        for metric in per_service:
            with contextlib.suppress(KeyError):
                metric.remove(namespace, name)
        for direction in ("up", "down"):
            with contextlib.suppress(KeyError):
                self.scale_events.remove(namespace, name, direction)
