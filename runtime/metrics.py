"""Prometheus metrics of a serving process, under kvfleet's names and, as aliases, under vLLM's.

The aliases let existing vLLM dashboards, KEDA triggers and autoscalers work unchanged. Engine-wide state
(queue depths, KV usage, cumulative scheduler counters) is read from the engine's latest snapshot at scrape
time; per-request observations (tokens, latencies) are recorded as outputs arrive, labelled by SLA tier
under kvfleet's names (vLLM's names keep vLLM's labels).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfleet.contract.metrics import (
    GENERATION_TOKENS,
    ITL,
    ITL_BUCKETS,
    KV_CACHE_USAGE,
    KV_EVENT_BATCHES_DROPPED,
    KV_EVENT_BATCHES_REPLAYED,
    KV_EVENTS_PUBLISHED,
    KVFLEET_PREFIX,
    LORA_ADAPTER_INFO,
    LORA_INT_ID_LABEL,
    LORA_NAME_LABEL,
    PHASE_LABEL,
    PROMPT_TOKENS,
    QUEUED_PROMPT_TOKENS,
    RESUMED_REQUESTS,
    RESUMED_TOKENS,
    RUNNING,
    STARTUP_PHASE_SECONDS,
    STARTUP_SECONDS,
    TTFT,
    TTFT_BUCKETS,
    VLLM_PREFIX,
    WAITING,
)
from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.errors import QUEUE_LIMITS
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    # Only annotated: the engine records into these metrics, so importing its outputs would tie the two.
    from kvfleet.runtime.engine.outputs import RequestMetrics, RequestOutput
    from kvfleet.runtime.tracing import RequestSpan

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Set (by `kvfleet serve --api-server-count N`) when several processes record metrics together.
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"

_REQUEST_BUCKETS = (
    0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
    7680.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)

# vLLM's sleep_state label values, by sleep level (0: awake).
_SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

# Most urgent first: the reason a multi-sequence request is counted under.
_FINISH_REASON_ORDER = ("error", "timeout", "abort", "length", "stop")


@dataclass(frozen=True, eq=False)
class _Pair:
    """One observation recorded under kvfleet's name (with the tier) and vLLM's (without)."""

    kvfleet: Counter | Histogram
    vllm: tuple[Counter | Histogram, ...]
    model_name: str
    # Each tier's series, as the methods that record into them. prometheus_client's labels() takes a lock and
    # checks the label values at every call, three quarters of what a token's observations cost.
    _recorders: dict[str, tuple[Callable[[float], None], ...]] = field(default_factory=dict)

    def record(self, tier: str, value: float) -> None:
        recorders = self._recorders.get(tier)
        if recorders is None:
            series = [
                self.kvfleet.labels(model_name=self.model_name, tier=tier),
                *(metric.labels(model_name=self.model_name) for metric in self.vllm),
            ]
            method = "inc" if isinstance(self.kvfleet, Counter) else "observe"
            recorders = self._recorders[tier] = tuple(getattr(child, method) for child in series)
        for record in recorders:
            record(value)


class ServerMetrics:
    def __init__(self, model_name: str, *, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self._stats_source: Callable[[], SchedulerStats | None] = lambda: None
        self._engine_stats = _EngineStatsCollector(model_name, lambda: self._stats_source())
        self.registry.register(self._engine_stats)
        self._lora_adapters_source: Callable[[], dict[str, int]] = dict
        self._lora_adapters = _LoRAAdaptersCollector(model_name, lambda: self._lora_adapters_source())
        self.registry.register(self._lora_adapters)
        self._startup = _StartupCollector(model_name)
        self.registry.register(self._startup)
        ProcessCollector(registry=self.registry)

        self._prompt_tokens = self._counter(
            PROMPT_TOKENS, "Prompt tokens of requests whose prefill finished."
        )
        self._generation_tokens = self._counter(GENERATION_TOKENS, "Generated tokens.")
        self._ttft = self._histogram(TTFT, "Time to first token.", TTFT_BUCKETS)
        self._itl = self._histogram(
            ITL,
            "Time between successive output tokens of a request.",
            ITL_BUCKETS,
            extra_vllm=("time_per_output_token_seconds",),
        )
        self._tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            ITL_BUCKETS,
        )
        self._e2e = self._histogram(
            "e2e_request_latency_seconds", "Arrival to last token of finished requests.", _REQUEST_BUCKETS
        )
        self._queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS
        )
        self._prefill_time = self._histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", _REQUEST_BUCKETS
        )
        self._decode_time = self._histogram(
            "request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS
        )
        self._request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", _TOKEN_BUCKETS
        )
        self._request_generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens of finished requests.", _TOKEN_BUCKETS
        )
        self._finished_kvfleet = Counter(
            "kvfleet:requests_finished",
            "Finished requests by finish reason (stop, length, abort, timeout, error).",
            ["model_name", "finished_reason", "tier"],
            registry=self.registry,
        )
        self._finished_vllm = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._lora_requests = Counter(
            "kvfleet:lora_requests",
            "Requests per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=self.registry,
        )
        self._lora_generation_tokens = Counter(
            "kvfleet:lora_generation_tokens",
            "Tokens generated per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=self.registry,
        )
        self._rejected, self._admission_rejections = self._rejection_counters()
        self._resumed_requests, self._resumed_tokens = self._continuation_counters()

    def _rejection_counters(self) -> tuple[Counter, Counter]:
        """Requests refused before running, kvfleet's by reason and tier; and vLLM's admission_rejections,
        those a queue limit refused, by the limit."""
        rejected = Counter(
            "kvfleet:requests_rejected",
            "Requests refused before running: overloaded (queue full), shed (displaced by a higher tier), "
            "draining, unavailable, or a queue limit (max_num_queued_reqs, max_num_queued_tokens).",
            ["model_name", "reason", "tier"],
            registry=self.registry,
        )
        admission_rejections = Counter(
            "vllm:admission_rejections",
            "Requests refused by a queue limit (max_num_queued_reqs, max_num_queued_tokens), by the limit.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        return rejected, admission_rejections

    def _continuation_counters(self) -> tuple[Counter, Counter]:
        """kvfleet's alone: continuations served, and the output tokens they brought that were computed
        again with their prompts."""
        labels = ["model_name", "tier"]
        requests = Counter(
            RESUMED_REQUESTS,
            "Continuations served: requests resumed from the output another replica delivered.",
            labels,
            registry=self.registry,
        )
        tokens = Counter(
            RESUMED_TOKENS,
            "Output tokens that continuations brought and that were computed again with their prompts.",
            labels,
            registry=self.registry,
        )
        return requests, tokens

    def _counter(self, name: str, documentation: str) -> _Pair:
        return _Pair(
            Counter(KVFLEET_PREFIX + name, documentation, ["model_name", "tier"], registry=self.registry),
            (Counter(VLLM_PREFIX + name, documentation, ["model_name"], registry=self.registry),),
            self.model_name,
        )

    def _histogram(
        self, name: str, documentation: str, buckets: tuple[float, ...], extra_vllm: tuple[str, ...] = ()
    ) -> _Pair:
        kvfleet = Histogram(
            KVFLEET_PREFIX + name,
            documentation,
            ["model_name", "tier"],
            buckets=buckets,
            registry=self.registry,
        )
        vllm = tuple(
            Histogram(
                VLLM_PREFIX + alias, documentation, ["model_name"], buckets=buckets, registry=self.registry
            )
            for alias in (name, *extra_vllm)
        )
        return _Pair(kvfleet, vllm, self.model_name)

    # ---- engine state ------------------------------------------------------------------------------

    def set_engine_info(self, *, attention_backend: str, device: str, dtype: str) -> None:
        """What the engine settled on at start (the attention backend comes from a benchmark), as labels."""
        Gauge(
            "kvfleet:engine_info",
            "The engine's configuration as labels; the value is always 1.",
            ["model_name", "attention_backend", "device", "dtype"],
            registry=self.registry,
            multiprocess_mode="max",
        ).labels(self.model_name, attention_backend, device, dtype).set(1)

    def set_startup(self, ready_seconds: float, phases: Callable[[], dict[str, float]]) -> None:
        """This server's time to Ready, and where its processes' start phases are read at scrape time (some of
        the API server's may end after the engine is ready)."""
        self._startup.ready_seconds = ready_seconds
        self._startup.phases = phases

    def set_stats_source(self, source: Callable[[], SchedulerStats | None]) -> None:
        """Where scrapes read the engine's current queue depths, KV usage and cumulative counters."""
        self._stats_source = source

    # ---- requests ------------------------------------------------------------------------------------

    def track(
        self, tier: str, num_prompt_tokens: int, lora_name: str | None = None, span: RequestSpan | None = None
    ) -> RequestTracker:
        if lora_name is not None:
            self._lora_requests.labels(model_name=self.model_name, lora_name=lora_name).inc()
        return RequestTracker(self, tier, num_prompt_tokens, lora_name, span)

    def set_lora_adapters_source(self, source: Callable[[], dict[str, int]]) -> None:
        """Where scrapes read the LoRA adapters this server serves: their lora_int_ids by name."""
        self._lora_adapters_source = source

    def forget_lora(self, lora_name: str) -> None:
        """Drop an unloaded adapter's series: only served adapters have them, so loading and unloading names
        cannot grow /metrics past what the operator reads."""
        for counter in (self._lora_requests, self._lora_generation_tokens):
            with contextlib.suppress(KeyError):
                counter.remove(self.model_name, lora_name)

    def record_rejected(self, reason: str, tier: str) -> None:
        self._rejected.labels(model_name=self.model_name, reason=reason, tier=tier).inc()
        if reason in QUEUE_LIMITS:
            self._admission_rejections.labels(model_name=self.model_name, reason=reason).inc()

    def record_resumed(self, tier: str, num_prefilled_tokens: int) -> None:
        """A continuation arrived; `num_prefilled_tokens` of the output it brings are computed again."""
        self._resumed_requests.labels(model_name=self.model_name, tier=tier).inc()
        self._resumed_tokens.labels(model_name=self.model_name, tier=tier).inc(num_prefilled_tokens)

    def _record_finished(self, reason: str, tier: str) -> None:
        self._finished_kvfleet.labels(model_name=self.model_name, finished_reason=reason, tier=tier).inc()
        self._finished_vllm.labels(model_name=self.model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        if MULTIPROCESS_DIR not in os.environ:
            return generate_latest(self.registry)
        # Several API servers: the request metrics of all of them, from their shared files, and the engine's
        # stats, which every one of them receives.
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self._engine_stats)
        # Every API server serves the same adapters: several processes exclude run-time updates.
        registry.register(self._lora_adapters)
        registry.register(self._startup)
        return generate_latest(registry)


class RequestTracker:
    """Turns one request's stream of delta outputs into observations: the metrics', and its span's where it
    is traced."""

    def __init__(
        self,
        metrics: ServerMetrics,
        tier: str,
        num_prompt_tokens: int,
        lora_name: str | None = None,
        span: RequestSpan | None = None,
    ) -> None:
        self._metrics = metrics
        self._tier = tier
        self._lora_tokens = (
            metrics._lora_generation_tokens.labels(model_name=metrics.model_name, lora_name=lora_name)
            if lora_name is not None
            else None
        )
        self._num_prompt_tokens = num_prompt_tokens
        self._num_generated = 0
        self._last_token_time: float | None = None
        self._span = span
        # The request's times as its latest output had them.
        self._times: RequestMetrics | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        if self._done:
            return
        metrics, tier = self._metrics, self._tier
        new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if new_tokens:
            self._num_generated += new_tokens
            metrics._generation_tokens.record(tier, new_tokens)
            if self._lora_tokens is not None:
                self._lora_tokens.inc(new_tokens)
        times = output.metrics
        self._times = times or self._times
        if times is not None and times.last_token_time is not None:
            if self._last_token_time is None:
                metrics._prompt_tokens.record(tier, self._num_prompt_tokens)
                if times.first_token_time is not None:
                    metrics._ttft.record(tier, times.first_token_time - times.arrival_time)
                    if times.first_scheduled_time is not None:
                        metrics._queue_time.record(tier, times.first_scheduled_time - times.arrival_time)
                        metrics._prefill_time.record(
                            tier, times.first_token_time - times.first_scheduled_time
                        )
            elif times.last_token_time > self._last_token_time:
                metrics._itl.record(tier, times.last_token_time - self._last_token_time)
            self._last_token_time = times.last_token_time
        if output.finished:
            reasons = {completion.finish_reason for completion in output.outputs}
            reason = next((r for r in _FINISH_REASON_ORDER if r in reasons), "stop")
            self._finish(reason, output)

    def aborted(self) -> None:
        """The request was stopped from outside (client gone, drain timeout) and will send nothing more."""
        if not self._done:
            self._done = True
            self._metrics._record_finished("abort", self._tier)
            self._end_span("abort")

    def _finish(self, reason: str, output: RequestOutput) -> None:
        self._done = True
        metrics, tier = self._metrics, self._tier
        metrics._record_finished(reason, tier)
        times = output.metrics
        if reason in ("stop", "length") and times is not None and times.finished_time is not None:
            metrics._e2e.record(tier, times.finished_time - times.arrival_time)
            metrics._request_prompt_tokens.record(tier, self._num_prompt_tokens)
            metrics._request_generation_tokens.record(tier, self._num_generated)
            if times.first_token_time is not None and times.last_token_time is not None:
                decode = times.last_token_time - times.first_token_time
                metrics._decode_time.record(tier, decode)
                per_sequence = self._num_generated / max(len(output.outputs), 1)
                if per_sequence > 1:
                    metrics._tpot.record(tier, decode / (per_sequence - 1))
        self._end_span(reason)

    def _end_span(self, reason: str) -> None:
        if self._span is not None:
            self._span.end([reason], self._times, self._num_prompt_tokens, self._num_generated)


@dataclass(frozen=True)
class _StatSeries:
    """One engine-wide value, read from the scheduler's stats at scrape time."""

    name: str
    documentation: str
    value: Callable[[SchedulerStats], float]
    counter: bool = False
    # vLLM's names beside `vllm:<name>`; None: kvfleet's own, which vLLM has no counterpart of.
    vllm_aliases: tuple[str, ...] | None = ()

    def names(self) -> list[str]:
        if self.vllm_aliases is None:
            return [KVFLEET_PREFIX + self.name]
        return [
            KVFLEET_PREFIX + self.name,
            *(VLLM_PREFIX + alias for alias in (self.name, *self.vllm_aliases)),
        ]


def _series(
    name: str,
    documentation: str,
    attribute: str | None = None,
    *,
    counter: bool = True,
    vllm_aliases: tuple[str, ...] | None = (),
) -> _StatSeries:
    """A series of the stats' field `attribute` (by default, `name`)."""
    field_name = attribute or name
    return _StatSeries(name, documentation, lambda stats: getattr(stats, field_name), counter, vllm_aliases)


def _draft_acceptance_rate(stats: SchedulerStats) -> float:
    draft_tokens = stats.spec_decode_num_draft_tokens
    return stats.spec_decode_num_accepted_tokens / draft_tokens if draft_tokens else 0.0


def _mean_acceptance_length(stats: SchedulerStats) -> float:
    drafts = stats.spec_decode_num_drafts
    return 1 + stats.spec_decode_num_accepted_tokens / drafts if drafts else 0.0


_SHARED_SERIES = (
    _series(RUNNING, "Requests in the running batch.", "num_running", counter=False),
    _series(
        WAITING,
        "Requests waiting to be scheduled (the queue depth to scale on).",
        "num_waiting",
        counter=False,
    ),
    _series(
        KV_CACHE_USAGE,
        "Fraction of KV cache blocks in use (0 to 1).",
        "kv_cache_usage",
        counter=False,
        vllm_aliases=("gpu_cache_usage_perc",),
    ),
    _series("num_preemptions", "Preemptions by recompute.", "num_preempted_total"),
    _series("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    _series("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    _series("spec_decode_num_drafts", "Speculative decoding: times a request verified draft tokens."),
    _series("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
    _series("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
)
_ACCEPTED_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
# kvfleet's own: vLLM logs the speculative-decoding ratios instead, and has no counterparts of the rest.
_OWN_SERIES = (
    _StatSeries(
        "spec_decode_draft_acceptance_rate",
        "Speculative decoding: accepted draft tokens per draft token verified, since start.",
        _draft_acceptance_rate,
        vllm_aliases=None,
    ),
    _StatSeries(
        QUEUED_PROMPT_TOKENS.removeprefix(KVFLEET_PREFIX),
        "Prompt tokens still to compute, of the waiting and running requests (tokens a prefill replica "
        "computed are not).",
        lambda stats: stats.num_queued_prompt_tokens,
        counter=False,
        vllm_aliases=None,
    ),
    _StatSeries(
        "kv_transfer_blocks_held",
        "Disaggregated prefill: KV blocks held now for decode replicas to pull.",
        lambda stats: stats.kv_transfer_blocks_held,
        counter=False,
        vllm_aliases=None,
    ),
    *(
        _StatSeries(name.removeprefix(KVFLEET_PREFIX), documentation, value, counter=True, vllm_aliases=None)
        for name, documentation, value in (
            (
                KV_EVENTS_PUBLISHED,
                "KV-cache events sent to subscribers (blocks stored, removed, all cleared).",
                lambda stats: stats.kv_events_published,
            ),
            (
                KV_EVENT_BATCHES_DROPPED,
                "KV-cache event batches dropped, the oldest first, because the publisher's queue was full.",
                lambda stats: stats.kv_event_batches_dropped,
            ),
            (
                KV_EVENT_BATCHES_REPLAYED,
                "KV-cache event batches sent again to subscribers that asked the replay socket.",
                lambda stats: stats.kv_event_batches_replayed,
            ),
        )
    ),
    _StatSeries(
        "spec_decode_mean_acceptance_length",
        "Speculative decoding: tokens each verification emits on average (accepted drafts + 1).",
        _mean_acceptance_length,
        vllm_aliases=None,
    ),
    *(
        _series(name, documentation, attribute, vllm_aliases=None)
        for name, documentation, attribute in (
            (
                "kv_offload_blocks_offloaded",
                "KV blocks copied to the host tier (of preempted requests, and evicted prefix-cache blocks).",
                None,
            ),
            ("kv_offload_blocks_reloaded", "KV blocks copied back from the host tier.", None),
            ("kv_offload_resumed_from_host", "Preempted requests that resumed from the host tier.", None),
            ("kv_offload_resumed_by_recompute", "Preempted requests that resumed by recompute.", None),
            (
                "kv_offload_prefix_blocks_spilled",
                "Prefix-cache blocks evicted from the device and kept in the host tier.",
                None,
            ),
            (
                "kv_offload_prefix_blocks_loaded",
                "Prefix-cache hits in the host tier, in blocks copied back to the device.",
                None,
            ),
            (
                "kv_transfer_loads",
                "Disaggregated decode: prompt KV loads from prefill replicas completed.",
                None,
            ),
            (
                "kv_transfer_blocks_pulled",
                "Disaggregated decode: KV blocks pulled from prefill replicas.",
                None,
            ),
            ("kv_transfer_bytes_pulled", "Disaggregated decode: bytes of the KV blocks pulled.", None),
            ("kv_transfer_pull_seconds", "Disaggregated decode: time the completed pulls took.", None),
            (
                "kv_transfer_holds_expired",
                "Disaggregated prefill: prompts whose KV blocks waited hold_timeout_s unpulled, then freed.",
                None,
            ),
            (
                "mm_encoder_runs",
                "Multimodal items (images) run through their encoder; repeats are served from the cache.",
                "encoder_runs",
            ),
            (
                "mm_encoder_cache_hits",
                "Multimodal item lookups the encoder cache answered.",
                "encoder_cache_hits",
            ),
            (
                "structured_output_grammars_compiled",
                "Grammars compiled for structured outputs (cache hits are not compilations).",
                "grammars_compiled",
            ),
            (
                "structured_output_compile_seconds",
                "Time spent compiling those grammars.",
                "grammar_compile_seconds",
            ),
            (
                "structured_output_mask_steps",
                "Engine steps that masked the logits of structured-output requests.",
                "grammar_mask_steps",
            ),
            (
                "structured_output_mask_seconds",
                "Time those steps spent filling and applying the grammars' token masks.",
                "grammar_mask_seconds",
            ),
        )
    ),
)


class _EngineStatsCollector(Collector):
    """Queue depths, KV usage and the scheduler's cumulative counters, read at scrape time."""

    def __init__(self, model_name: str, source: Callable[[], SchedulerStats | None]) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source() or SchedulerStats(0, 0, 0, 0.0, 0, 0, 0)
        for series in _SHARED_SERIES:
            yield from self._families(series, stats)
        for full_name in (KVFLEET_PREFIX + _ACCEPTED_PER_POSITION, VLLM_PREFIX + _ACCEPTED_PER_POSITION):
            family = CounterMetricFamily(
                full_name,
                "Speculative decoding: draft tokens accepted at each draft position (0: the first).",
                labels=["model_name", "position"],
            )
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                family.add_metric([self._model_name, str(position)], float(count))
            yield family
        for series in _OWN_SERIES:
            yield from self._families(series, stats)
        yield from self._kv_transfer_families(stats)
        yield from self._moe_families(stats)
        yield from self._sleep_families(stats)

    def _sleep_families(self, stats: SchedulerStats) -> Iterator[Metric]:
        for prefix in (KVFLEET_PREFIX, VLLM_PREFIX):
            family = GaugeMetricFamily(
                prefix + "engine_sleep_state",
                "Sleep mode: 1 for the engine's state (awake; weights_offloaded: asleep at level 1, the KV "
                "cache freed; discard_all: level 2, the weights dropped too), 0 for the others.",
                labels=["model_name", "sleep_state"],
            )
            for level, state in enumerate(_SLEEP_STATES):
                family.add_metric([self._model_name, state], float(stats.sleep_level == level))
            yield family

    def _kv_transfer_families(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Fallbacks of disaggregated decode by reason; and vLLM's NixlConnector names for the pulls, as
        summaries (their _sum and _count, without quantiles) where vLLM's are histograms."""
        labels = [self._model_name]
        fallbacks = CounterMetricFamily(
            KVFLEET_PREFIX + "kv_transfer_fallbacks",
            "Disaggregated decode: KV loads that failed, by reason; the request recomputed its prompt (or, "
            "under kv_load_failure_policy fail, ended with an error).",
            labels=["model_name", "reason"],
        )
        for reason, count in sorted(stats.kv_transfer_fallbacks.items()):
            fallbacks.add_metric([*labels, reason], float(count))
        yield fallbacks
        failed = CounterMetricFamily(
            VLLM_PREFIX + "nixl_num_failed_transfers", "KV loads that failed.", labels=["model_name"]
        )
        failed.add_metric(labels, float(sum(stats.kv_transfer_fallbacks.values())))
        yield failed
        loads = float(stats.kv_transfer_loads)
        for name, documentation, total in (
            ("nixl_xfer_time_seconds", "Time of each completed KV load.", stats.kv_transfer_pull_seconds),
            ("nixl_bytes_transferred", "Bytes of each completed KV load.", stats.kv_transfer_bytes_pulled),
        ):
            family = SummaryMetricFamily(VLLM_PREFIX + name, documentation, labels=["model_name"])
            family.add_metric(labels, count_value=loads, sum_value=float(total))
            yield family

    def _moe_families(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Mixture-of-experts routing, one series per sparse layer and none per expert: a model's layers x
        experts (6,144 for Qwen3-30B-A3B) would make every replica's scrape the size of a fleet's. What an
        operator acts on, a layer whose tokens crowd onto few experts (and with expert parallelism onto
        their ranks), shows in the busiest expert's share; the expert's identity is not kept."""
        routed = CounterMetricFamily(
            KVFLEET_PREFIX + "moe_routed_tokens",
            "Mixture-of-experts models: token-expert pairs routed in each sparse layer (a token counts once "
            "for each of its top-k experts).",
            labels=["model_name", "layer"],
        )
        busiest = CounterMetricFamily(
            KVFLEET_PREFIX + "moe_busiest_expert_tokens",
            "Mixture-of-experts models: token-expert pairs routed to each sparse layer's busiest expert so "
            "far.",
            labels=["model_name", "layer"],
        )
        imbalance = GaugeMetricFamily(
            KVFLEET_PREFIX + "moe_expert_load_imbalance",
            "Mixture-of-experts models: each sparse layer's busiest expert's pairs over the mean of its "
            "experts', since start (1 when evenly routed, the number of experts when all go to one; 0 before "
            "any token).",
            labels=["model_name", "layer"],
        )
        for load in stats.moe_layer_load:
            labels = [self._model_name, str(load.layer)]
            routed.add_metric(labels, float(load.routed_tokens))
            busiest.add_metric(labels, float(load.busiest_expert_tokens))
            mean = load.routed_tokens / load.num_experts
            imbalance.add_metric(labels, load.busiest_expert_tokens / mean if mean else 0.0)
        yield from (routed, busiest, imbalance)

    def _families(self, series: _StatSeries, stats: SchedulerStats) -> Iterator[Metric]:
        family_type = CounterMetricFamily if series.counter else GaugeMetricFamily
        value = float(series.value(stats))
        for full_name in series.names():
            family = family_type(full_name, series.documentation, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family


class _LoRAAdaptersCollector(Collector):
    """The LoRA adapters served, read at scrape time: how many, and one series per adapter name, which is
    how the gateway learns where each adapter can run (/metrics needs no API key, /v1/models does)."""

    def __init__(self, model_name: str, source: Callable[[], dict[str, int]]) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[Metric]:
        names = self._source()
        count = GaugeMetricFamily(
            "kvfleet:lora_adapters_loaded", "LoRA adapters this server serves by name.", labels=["model_name"]
        )
        count.add_metric([self._model_name], float(len(names)))
        yield count
        info = GaugeMetricFamily(
            LORA_ADAPTER_INFO,
            f"One series per LoRA adapter this server serves (its name in {LORA_NAME_LABEL}, the seed of its "
            f"prefix-cache block hashes in {LORA_INT_ID_LABEL}); the value is always 1.",
            labels=["model_name", LORA_NAME_LABEL, LORA_INT_ID_LABEL],
        )
        for name, lora_int_id in names.items():
            info.add_metric([self._model_name, name, str(lora_int_id)], 1.0)
        yield info


class _StartupCollector(Collector):
    """Where the start went, once the engine is ready: gauges, because each phase happens once in a process's
    life (a histogram would hold a single observation per series, and its buckets would say less than the
    value); a fleet's starts are compared across pods with Prometheus's own aggregations of the gauges."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self.ready_seconds: float | None = None
        self.phases: Callable[[], dict[str, float]] = dict

    def collect(self) -> Iterator[Metric]:
        if self.ready_seconds is None:
            return
        ready = GaugeMetricFamily(
            STARTUP_SECONDS,
            "Seconds from the API server process's start to the engine being ready.",
            labels=["model_name"],
        )
        ready.add_metric([self._model_name], self.ready_seconds)
        yield ready
        phases = GaugeMetricFamily(
            STARTUP_PHASE_SECONDS,
            "Seconds each phase of the start took, in the API server's process or the engine core's (whose "
            "phases overlap the API server's).",
            labels=["model_name", PHASE_LABEL],
        )
        for phase, seconds in self.phases().items():
            phases.add_metric([self._model_name, phase], seconds)
        yield phases
