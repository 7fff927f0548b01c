"""The gateway's Prometheus metrics, per model, in a registry of its own.

`kvfleet_gateway_queue_depth` is what the operator's autoscaler reads beside the replicas' own queues: a
model scaled to zero with requests held here is scaled back to one.
"""

from __future__ import annotations

import contextlib

from kvfleet.contract.metrics import (
    GATEWAY_HELD,
    GATEWAY_QUEUE_DEPTH,
    GATEWAY_REJECTED,
    GATEWAY_ROUTING_DECISIONS,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Upstream waits span a cached short answer to a model starting from zero.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge(
            GATEWAY_QUEUE_DEPTH,
            "Requests held in the gateway waiting for a replica.",
            ["model"],
            registry=self.registry,
        )
        self.ready_replicas = Gauge(
            "kvfleet_gateway_ready_replicas",
            "Ready replicas the gateway routes to.",
            ["model"],
            registry=self.registry,
        )
        self.requests = Counter(
            "kvfleet_gateway_requests",
            "Requests answered, by HTTP status.",
            ["model", "status"],
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            GATEWAY_ROUTING_DECISIONS,
            "Requests sent to a replica (retries included), by policy and replica.",
            ["model", "policy", "endpoint"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvfleet_gateway_retries",
            "Requests sent again to another replica before their first byte, by reason.",
            ["model", "reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            GATEWAY_REJECTED,
            "Requests the gateway's flow control refused, by reason and tier.",
            ["model", "reason", "tier"],
            registry=self.registry,
        )
        self.held = Counter(
            GATEWAY_HELD,
            "Requests that waited in the queue because no replica had room for them (retries included), by "
            "tier.",
            ["model", "tier"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvfleet_gateway_queue_wait_seconds",
            "Time from arrival until a replica was chosen.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "kvfleet_gateway_upstream_latency_seconds",
            "Time from sending a request to a replica until its response headers arrived.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.activation = Histogram(
            "kvfleet_gateway_activation_seconds",
            "Time from a request for a model with no ready replica until its response began.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resume = ResumeMetrics(self.registry)
        self.pd = PrefillDecodeMetrics(self.registry)
        self.kv_index = KVIndexMetrics(self.registry)
        self.precise = PrecisePrefixMetrics(self.registry)

    def forget(self, model: str) -> None:
        """Drops a removed model's gauges, so a dashboard does not show it forever."""
        for gauge in (self.queue_depth, self.ready_replicas):
            with contextlib.suppress(KeyError):
                gauge.remove(model)


class PrecisePrefixMetrics:
    """Of the precise-prefix policy's choices."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvfleet_gateway_precise_prefix_decisions",
            "precise-prefix routing decisions (retries included), by reason: device_hit (the replica chosen "
            "holds some of the prompt's leading blocks on its device), host_hit (in its host tier only), "
            "no_hit, "
            "not_tokenized (the gateway could not hash the prompt), over_load_bound (a replica holding more "
            "of the prompt was over the load bound).",
            ["model", "reason"],
            registry=registry,
        )
        self.hit_blocks = Counter(
            "kvfleet_gateway_precise_prefix_hit_blocks",
            "The prompt's leading blocks that the replica chosen by precise-prefix holds, by medium (device, "
            "host).",
            ["model", "medium"],
            registry=registry,
        )


class ResumeMetrics:
    """Of streams resumed on another replica after their first byte."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.resumes = Counter(
            "kvfleet_gateway_resumes",
            "Streams resumed on another replica after their first byte, by cause: reset (the connection "
            "broke or ended before [DONE]), error (a 5xx error frame), stall (no chunk within the stall "
            "timeout), drain (a draining replica handed the request back).",
            ["model", "cause"],
            registry=registry,
        )
        self.resumed_tokens = Counter(
            "kvfleet_gateway_resumed_tokens",
            "Output tokens sent to a replica in a continuation, which it computes again as prompt.",
            ["model"],
            registry=registry,
        )
        self.resume_seconds = Histogram(
            "kvfleet_gateway_resume_seconds",
            "Time from a stream's failure until the replica resuming it sent its first token (or its end).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


class PrefillDecodeMetrics:
    """Of the models with prefill replicas (disaggregated prefill and decode)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvfleet_gateway_pd_requests",
            "Requests of a model with prefill replicas, by path: `disaggregated` (prefilled by a prefill "
            "replica) or `decode_only` (below the threshold of new tokens, or after a prefill fallback).",
            ["model", "path"],
            registry=registry,
        )
        self.prefill_fallbacks = Counter(
            "kvfleet_gateway_pd_prefill_fallbacks",
            "Requests sent to their decode replica without prefill because the prefill step failed, by "
            "reason: busy (no prefill replica had room), unreachable, timeout, error_status, no_params.",
            ["model", "reason"],
            registry=registry,
        )
        self.prefill_duration = Histogram(
            "kvfleet_gateway_pd_prefill_duration_seconds",
            "Time from sending a prefill call to a prefill replica until its answer was read (or failed).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


class KVIndexMetrics:
    """Of the index of the replicas' cached blocks that precise-prefix routes on, and the KV events that
    keep it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.index_blocks = Gauge(
            "kvfleet_gateway_kv_index_blocks",
            "Entries of the KV block index: (replica, block, medium) triples.",
            registry=registry,
        )
        self.events = Counter(
            "kvfleet_gateway_kv_events",
            "KV events received from the replicas and applied to the index, by type.",
            ["type"],
            registry=registry,
        )
        self.replays = Counter(
            "kvfleet_gateway_kv_event_replays",
            "Replays asked of a replica's replay socket, by outcome: complete, unreplayable (the replica no "
            "longer holds the missing batches), timeout, broken (a malformed answer), unavailable (no replay "
            "socket).",
            ["outcome"],
            registry=registry,
        )
        self.drops = Counter(
            "kvfleet_gateway_kv_index_drops",
            "Times a replica's entries were dropped from the index, by reason: restarted (its sequence went "
            "back), unreplayable_gap, replay_timeout, malformed, undecodable, invalid_batch, "
            "oversized_batch, replica_removed.",
            ["reason"],
            registry=registry,
        )
