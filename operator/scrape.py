"""Reading queue metrics straight from each ready replica's /metrics (no Prometheus in between).

kvfleet's own metric names are read first; vLLM's names are the fallback, so vLLM pods scale too.
A page is read up to a byte cap and no further: whatever a pod answers, one scrape holds at most that much.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
from kvfleet.contract.metrics import (
    GATEWAY_HELD,
    GATEWAY_QUEUE_DEPTH,
    GATEWAY_REJECTED,
    GATEWAY_ROUTING_DECISIONS,
    GENERATION_TOKENS,
    ITL,
    KV_CACHE_USAGE,
    PREFIXES,
    PROMPT_TOKENS,
    QUEUED_PROMPT_TOKENS,
    RUNNING,
    TTFT,
    WAITING,
)
from kvfleet.operator.autoscaler import Buckets, PodMetrics, Waits
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# The latency histograms the autoscaler reads as means and percentiles between scrapes.
_HISTOGRAMS = (TTFT, ITL)
_WANTED = frozenset(
    {
        QUEUED_PROMPT_TOKENS,
        *(
            prefix + name
            for prefix in PREFIXES
            for name in (
                WAITING,
                RUNNING,
                KV_CACHE_USAGE,
                f"{PROMPT_TOKENS}_total",
                f"{GENERATION_TOKENS}_total",
                *(
                    f"{histogram}{part}"
                    for histogram in _HISTOGRAMS
                    for part in ("_sum", "_count", "_bucket")
                ),
            )
        ),
    }
)
# A kvfleet replica's page with every SLA tier and finish reason in use is about 150 KB: room to spare, while
# a pod that answers without end costs the operator 1 MiB a scrape.
DEFAULT_MAX_PAGE_BYTES = 1024 * 1024


class ScrapeFailure(enum.Enum):
    """Why a replica gave the autoscaler no figures; each one counts as a failed scrape."""

    # Refused, timed out, an error status or a page that is not text.
    NO_ANSWER = "no answer"
    NO_QUEUE_METRICS = "no queue metrics"
    # The page passed the operator's byte cap (--scrape-max-bytes); the rest was never read.
    PAGE_TOO_LARGE = "page too large"


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    ip: str
    port: int

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ipaddress.ip_address(self.ip).version == 6 else self.ip
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/metrics"


@dataclass(frozen=True)
class Exposition:
    """The values the autoscaler reads from one /metrics page, summed over label sets."""

    waiting: float | None
    running: float | None
    kv_cache_usage: float | None
    queued_prompt_tokens: float | None
    # The token counters: prompt tokens of requests whose prefill finished, tokens generated.
    prompt_tokens: float | None
    generation_tokens: float | None
    # Each latency histogram's (sum, count), by name.
    histograms: dict[str, tuple[float, float]]
    # Each latency histogram's cumulative buckets, by name, from the family of its sum and count.
    buckets: dict[str, Buckets] = field(default_factory=dict)


def parse_exposition(text: str) -> Exposition:
    """Picks the autoscaler's metrics out of Prometheus text format; everything else is skipped unparsed."""
    totals: dict[str, float] = {}
    # (name, upper bound) -> observations at or below it, over label sets.
    bucket_totals: dict[tuple[str, float], float] = {}
    for sample in _samples(text, _WANTED):
        if sample.name.endswith("_bucket"):
            bound = _upper_bound(sample.labels.get("le"))
            if bound is not None:
                key = (sample.name, bound)
                bucket_totals[key] = bucket_totals.get(key, 0.0) + sample.value
            continue
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value

    def read(metric: str) -> float | None:
        for prefix in PREFIXES:
            if prefix + metric in totals:
                return totals[prefix + metric]
        return None

    histograms = {}
    buckets: dict[str, Buckets] = {}
    for histogram in _HISTOGRAMS:
        # Sum and count must come from the same family, or their ratio means nothing.
        names = next(
            (
                (p + f"{histogram}_sum", p + f"{histogram}_count")
                for p in PREFIXES
                if p + f"{histogram}_sum" in totals and p + f"{histogram}_count" in totals
            ),
            None,
        )
        if names is not None:
            histograms[histogram] = totals[names[0]], totals[names[1]]
            bucket_name = names[0].removesuffix("_sum") + "_bucket"
            family = sorted(
                (bound, count) for (name, bound), count in bucket_totals.items() if name == bucket_name
            )
            if family and family[-1][0] == math.inf:
                buckets[histogram] = tuple(family)
    return Exposition(
        waiting=read(WAITING),
        running=read(RUNNING),
        kv_cache_usage=read(KV_CACHE_USAGE),
        queued_prompt_tokens=totals.get(QUEUED_PROMPT_TOKENS),
        prompt_tokens=read(f"{PROMPT_TOKENS}_total"),
        generation_tokens=read(f"{GENERATION_TOKENS}_total"),
        histograms=histograms,
        buckets=buckets,
    )


def _upper_bound(le: str | None) -> float | None:
    try:
        return float(le) if le is not None else None
    except ValueError:
        return None


async def fetch_page(
    session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout, max_page_bytes: int
) -> str | ScrapeFailure:
    """A /metrics page as text, read no further than the byte cap."""
    try:
        async with session.get(url, timeout=timeout) as response:
            if response.status != 200:
                return ScrapeFailure.NO_ANSWER
            body = await read_capped(response, max_page_bytes)
            if body is None:
                return ScrapeFailure.PAGE_TOO_LARGE
            # The text format is UTF-8; a charset the page names is honoured, as aiohttp's text() does.
            return body.decode(response.charset or "utf-8")
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, LookupError):
        return ScrapeFailure.NO_ANSWER


async def read_capped(response: aiohttp.ClientResponse, max_page_bytes: int) -> bytes | None:
    """The body, read as it arrives; None once it passes the cap, when the connection is closed unread."""
    if response.content_length is not None and response.content_length > max_page_bytes:
        response.close()
        return None
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > max_page_bytes:
            response.close()
            return None
    return bytes(body)


class FleetScraper:
    """Scrapes one service's replicas; remembers each replica's latency counters to report interval means."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeout_seconds: float,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._clock = clock
        # pod -> (when, prompt tokens, generation tokens) at the previous scrape.
        self._tokens: dict[str, tuple[float, float | None, float | None]] = {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._max_page_bytes = max_page_bytes
        # (pod, histogram) -> its (sum, count) at the previous scrape.
        self._counters: dict[tuple[str, str], tuple[float, float]] = {}
        # (pod, histogram) -> its cumulative buckets at the previous scrape.
        self._buckets: dict[tuple[str, str], Buckets] = {}

    async def scrape(self, targets: Sequence[ScrapeTarget]) -> list[PodMetrics | ScrapeFailure]:
        pages = await asyncio.gather(*(self._fetch(target) for target in targets))
        now = self._clock()
        live = {target.pod for target in targets}
        self._tokens = {pod: value for pod, value in self._tokens.items() if pod in live}
        self._counters = {key: value for key, value in self._counters.items() if key[0] in live}
        self._buckets = {key: value for key, value in self._buckets.items() if key[0] in live}
        return [self._to_metrics(target.pod, page, now) for target, page in zip(targets, pages, strict=True)]

    async def _fetch(self, target: ScrapeTarget) -> Exposition | ScrapeFailure:
        page = await fetch_page(self._session, target.url, self._timeout, self._max_page_bytes)
        return page if isinstance(page, ScrapeFailure) else parse_exposition(page)

    def _to_metrics(
        self, pod: str, page: Exposition | ScrapeFailure, now: float
    ) -> PodMetrics | ScrapeFailure:
        if isinstance(page, ScrapeFailure):
            return page
        if page.waiting is None or page.running is None:
            return ScrapeFailure.NO_QUEUE_METRICS
        previous = self._tokens.get(pod)
        self._tokens[pod] = (now, page.prompt_tokens, page.generation_tokens)
        prompt_rate = generation_rate = None
        if previous is not None and now > previous[0]:
            prompt_rate = _rate(previous[1], page.prompt_tokens, now - previous[0])
            generation_rate = _rate(previous[2], page.generation_tokens, now - previous[0])
        return PodMetrics(
            waiting=page.waiting,
            running=page.running,
            kv_cache_usage=page.kv_cache_usage,
            ttft_seconds=self._interval_mean(pod, page, TTFT),
            queued_prompt_tokens=page.queued_prompt_tokens,
            itl_seconds=self._interval_mean(pod, page, ITL),
            ttft_buckets=self._interval_buckets(pod, page, TTFT),
            itl_buckets=self._interval_buckets(pod, page, ITL),
            prompt_tokens_per_s=prompt_rate,
            generation_tokens_per_s=generation_rate,
        )

    def _interval_buckets(self, pod: str, page: Exposition, histogram: str) -> Buckets | None:
        """A histogram's buckets of the observations since the previous scrape of the pod: the difference of
        its cumulative counts, bucket by bucket."""
        key = (pod, histogram)
        previous = self._buckets.pop(key, None)
        current = page.buckets.get(histogram)
        if current is None:
            return None
        self._buckets[key] = current
        if previous is None or [bound for bound, _ in previous] != [bound for bound, _ in current]:
            return None
        interval = tuple(
            (bound, count - before) for (bound, count), (_, before) in zip(current, previous, strict=True)
        )
        # A restarted replica resets its counters: no interval to measure until the next scrape.
        if any(count < 0 for _, count in interval):
            return None
        return interval

    def _interval_mean(self, pod: str, page: Exposition, histogram: str) -> float | None:
        """The mean of a histogram's observations since the previous scrape of the pod."""
        key = (pod, histogram)
        previous = self._counters.get(key)
        # A labelled histogram appears with its first observation: until then it is at zero.
        total, count = self._counters[key] = page.histograms.get(histogram, (0.0, 0.0))
        if previous is None:
            return None
        observed = count - previous[1]
        # A restarted replica resets its counters: no interval to measure until the next scrape.
        if observed <= 0 or total < previous[0]:
            return None
        return (total - previous[0]) / observed


def _rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """A counter's increase per second; None without both readings, or across a restart (a reset)."""
    if before is None or after is None or after < before:
        return None
    return (after - before) / seconds


@dataclass(frozen=True)
class GatewayQueue:
    """What the gateways report of one model: the requests they hold now, and their counts so far of the
    requests they sent to a replica, of those they refused and of those that waited for a replica's room."""

    held: float = 0.0
    routed: float = 0.0
    refused: float = 0.0
    waited: float = 0.0

    def refused_share_since(self, earlier: GatewayQueue | None) -> float:
        """Of the requests since `earlier`, the share refused; 0 without an earlier reading, or where a
        count fell (a gateway restarted, or one fewer answered)."""
        arrived = self.waits_since(earlier).arrived
        if earlier is None or arrived <= 0:
            return 0.0
        return (self.refused - earlier.refused) / arrived

    def waits_since(self, earlier: GatewayQueue | None) -> Waits:
        """The requests since `earlier`, sent to a replica or refused, and those that waited in the queue
        (requests that waited and wait still were neither sent nor refused yet); none as above."""
        if earlier is None:
            return Waits()
        routed, refused = self.routed - earlier.routed, self.refused - earlier.refused
        waited = self.waited - earlier.waited
        if routed < 0 or refused < 0 or waited < 0:
            return Waits()
        return Waits(routed + refused, waited)

    def __add__(self, other: GatewayQueue) -> GatewayQueue:
        return GatewayQueue(
            self.held + other.held,
            self.routed + other.routed,
            self.refused + other.refused,
            self.waited + other.waited,
        )


_GATEWAY_SAMPLES = {
    GATEWAY_QUEUE_DEPTH: "held",
    f"{GATEWAY_ROUTING_DECISIONS}_total": "routed",
    f"{GATEWAY_REJECTED}_total": "refused",
    f"{GATEWAY_HELD}_total": "waited",
}


def parse_gateway_queues(text: str) -> dict[str, GatewayQueue]:
    """The fleet gateway's queue per model from its /metrics page: what it holds, and its counts of the
    requests it routed and refused (over every label but the model)."""
    figures: dict[str, dict[str, float]] = {}
    for sample in _samples(text, frozenset(_GATEWAY_SAMPLES)):
        if "model" in sample.labels:
            model = figures.setdefault(sample.labels["model"], {})
            field_name = _GATEWAY_SAMPLES[sample.name]
            model[field_name] = model.get(field_name, 0.0) + sample.value
    return {model: GatewayQueue(**values) for model, values in figures.items()}


def _samples(text: str, names: frozenset[str]) -> Iterator[Sample]:
    """The finite samples of Prometheus text format named in `names`, read by prometheus_client's parser.

    Only lines that start with one of the names are parsed, each on its own: a line the parser refuses is
    skipped, and the rest of the page is still read.
    """
    starts = tuple(names)
    for line in text.splitlines():
        if not line.startswith(starts):
            continue
        try:
            samples = [sample for family in text_string_to_metric_families(line) for sample in family.samples]
        except ValueError:
            continue
        yield from (s for s in samples if s.name in names and math.isfinite(s.value))


class GatewayQueues:
    """The requests the gateway replicas hold per model, summed over them.

    Every service loop asks for its own model; one scrape of the gateways serves all of them for
    `max_age_seconds`.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeout_seconds: float,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        max_age_seconds: float = 1.0,
    ) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._max_page_bytes = max_page_bytes
        self._max_age = max_age_seconds
        self._lock = asyncio.Lock()
        self._cached: tuple[float, dict[str, GatewayQueue] | None] | None = None

    async def read(self, targets: Sequence[ScrapeTarget]) -> dict[str, GatewayQueue] | None:
        """Model -> its queue over the gateways; None when no gateway answered (or none runs)."""
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self._max_age:
                return self._cached[1]
            pages = await asyncio.gather(
                *(fetch_page(self._session, t.url, self._timeout, self._max_page_bytes) for t in targets)
            )
            answered = [parse_gateway_queues(page) for page in pages if not isinstance(page, ScrapeFailure)]
            totals: dict[str, GatewayQueue] | None = None
            if answered:
                totals = {}
                for queues in answered:
                    for model, queue in queues.items():
                        totals[model] = totals.get(model, GatewayQueue()) + queue
            self._cached = (now, totals)
            return totals
