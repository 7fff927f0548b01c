"""Scraping replicas' /metrics: the text format, name fallback, latency intervals (means and buckets), and
failing replicas."""

from __future__ import annotations

import asyncio
import math
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kvfleet.contract.metrics import (
    GATEWAY_QUEUE_DEPTH,
    GENERATION_TOKENS,
    ITL,
    PROMPT_TOKENS,
    QUEUED_PROMPT_TOKENS,
    TTFT,
    TTFT_BUCKETS,
)
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.operator.autoscaler import PodMetrics, Waits
from kvfleet.operator.scrape import (
    FleetScraper,
    GatewayQueue,
    ScrapeFailure,
    ScrapeTarget,
    parse_exposition,
    parse_gateway_queues,
)
from ports import free_port
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

KVFLEET_PAGE = """\
# HELP kvfleet:num_requests_waiting Requests waiting for a batch slot.
# TYPE kvfleet:num_requests_waiting gauge
kvfleet:num_requests_waiting{model_name="tiny"} 3.0
kvfleet:num_requests_running{model_name="tiny"} 5.0
kvfleet:kv_cache_usage_perc{model_name="tiny"} 0.25
kvfleet:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 4.0
kvfleet:time_to_first_token_seconds_sum{model_name="tiny"} 2.0
kvfleet:time_to_first_token_seconds_count{model_name="tiny"} 10.0
vllm:num_requests_waiting{model_name="tiny"} 3.0
vllm:num_requests_running{model_name="tiny"} 5.0
process_cpu_seconds_total 12.5
"""

VLLM_PAGE = """\
vllm:num_requests_waiting{engine="0",model_name="m"} 1
vllm:num_requests_waiting{engine="1",model_name="m"} 2
vllm:num_requests_running{engine="0",model_name="m"} 4 1700000000000
vllm:kv_cache_usage_perc{model_name="m"} 0.5
"""


def test_reads_kvfleet_names_first() -> None:
    page = parse_exposition(KVFLEET_PAGE)
    assert (page.waiting, page.running, page.kv_cache_usage) == (3.0, 5.0, 0.25)
    assert page.histograms[TTFT] == (2.0, 10.0)


def test_falls_back_to_vllm_names_and_sums_label_sets() -> None:
    page = parse_exposition(VLLM_PAGE)
    assert (page.waiting, page.running, page.kv_cache_usage) == (3.0, 4.0, 0.5)
    assert TTFT not in page.histograms


ROLE_PAGE = f"""\
kvfleet:num_requests_waiting 1
kvfleet:num_requests_running 2
{QUEUED_PROMPT_TOKENS}{{model_name="m"}} 1500
kvfleet:{ITL}_sum{{tier="standard"}} 0.5
kvfleet:{ITL}_count{{tier="standard"}} 20
kvfleet:{ITL}_sum{{tier="batch"}} 0.1
kvfleet:{ITL}_count{{tier="batch"}} 5
vllm:{ITL}_sum 9
vllm:{ITL}_count 1
"""


def test_reads_queued_prompt_tokens_and_inter_token_latency() -> None:
    page = parse_exposition(ROLE_PAGE)
    assert page.queued_prompt_tokens == 1500.0
    assert page.histograms[ITL] == (0.6, 25.0), "kvfleet's family, summed over its tiers"
    assert TTFT not in page.histograms
    assert parse_exposition(VLLM_PAGE).queued_prompt_tokens is None, "vLLM exports no such gauge"


def test_odd_lines_are_skipped() -> None:
    page = parse_exposition(
        'kvfleet:num_requests_waiting{model_name="a}b"} 2\n'
        "kvfleet:num_requests_waiting NaN\n"
        "kvfleet:num_requests_running\n"
        "kvfleet:num_requests_running{} not-a-number\n"
        "kvfleet:num_requests_running_total 9\n"
    )
    assert page.waiting == 2.0
    assert page.running is None


# Served names the text format must escape: a quote, a backslash, a newline, and a closing brace.
AWKWARD_NAMES = ['team-a/say "hi"', "team-a/C:\\models\\m", "team-a/two\nlines", "team-a/a} 9"]


def test_gateway_queues_read_escaped_model_names() -> None:
    # The gateway's own exposition is the oracle: what it sets is what the operator must read back.
    metrics = GatewayMetrics()
    held = {name: float(index + 1) for index, name in enumerate(AWKWARD_NAMES)}
    for name, depth in held.items():
        metrics.queue_depth.labels(name).set(depth)
    assert parse_gateway_queues(generate_latest(metrics.registry).decode()) == {
        name: GatewayQueue(held=depth) for name, depth in held.items()
    }


def test_gateway_queues_read_the_model_label_wherever_it_stands() -> None:
    page = (
        f'{GATEWAY_QUEUE_DEPTH}{{zone="b",model="team-a/m"}} 3\n'
        f'{GATEWAY_QUEUE_DEPTH}{{model="team-a/n",zone="b"}} 4\n'
        f'{GATEWAY_QUEUE_DEPTH}{{zone="b"}} 5\n'
    )
    held = {"team-a/m": GatewayQueue(held=3.0), "team-a/n": GatewayQueue(held=4.0)}
    assert parse_gateway_queues(page) == held


def test_the_share_the_gateways_refused_is_of_the_requests_since_the_earlier_reading() -> None:
    earlier = GatewayQueue(held=5, routed=100, refused=10)
    # 30 routed and 10 refused since: a quarter of the 40 were refused.
    assert GatewayQueue(held=0, routed=130, refused=20).refused_share_since(earlier) == 0.25
    assert GatewayQueue(routed=130, refused=10).refused_share_since(earlier) == 0.0
    # No earlier reading, or counts that fell (a gateway restarted): nothing to measure yet.
    assert GatewayQueue(routed=130, refused=20).refused_share_since(None) == 0.0
    assert GatewayQueue(routed=30, refused=20).refused_share_since(earlier) == 0.0


def test_the_waits_in_the_gateways_are_counted_among_the_requests_since_the_earlier_reading() -> None:
    earlier = GatewayQueue(held=5, routed=100, refused=10, waited=40)
    # 30 routed and 10 refused since, 8 of the 40 after waiting in the queue.
    waits = GatewayQueue(routed=130, refused=20, waited=48).waits_since(earlier)
    assert waits == Waits(arrived=40, waited=8) and waits.share == 0.2
    assert GatewayQueue(routed=130, refused=20, waited=40).waits_since(earlier).share == 0.0
    assert GatewayQueue(routed=130, refused=20, waited=48).waits_since(None) == Waits()
    # Five came and wait still, none routed or refused since: all of them waited.
    waiting = GatewayQueue(routed=100, refused=10, waited=45).waits_since(earlier)
    assert waiting == Waits(arrived=0, waited=5) and waiting.share == 1.0
    # A restarted gateway's counts fall.
    assert GatewayQueue(routed=130, refused=2, waited=48).waits_since(earlier) == Waits()
    assert GatewayQueue(routed=30, refused=20, waited=48).waits_since(earlier) == Waits()
    assert GatewayQueue(routed=130, refused=20, waited=4).waits_since(earlier) == Waits()


def test_replica_pages_with_escaped_labels_in_any_order_are_summed() -> None:
    registry = CollectorRegistry()
    waiting = Gauge("kvfleet:num_requests_waiting", "", ["tier", "model_name"], registry=registry)
    running = Gauge("kvfleet:num_requests_running", "", ["model_name", "tier"], registry=registry)
    for index, name in enumerate(AWKWARD_NAMES):
        waiting.labels("batch", name).set(index + 1)
        running.labels(name, "critical").set(10 * (index + 1))
    page = parse_exposition(generate_latest(registry).decode())
    count = len(AWKWARD_NAMES)
    assert (page.waiting, page.running) == (count * (count + 1) / 2, 10 * count * (count + 1) / 2)


def test_ipv6_targets_are_bracketed() -> None:
    assert ScrapeTarget("p", "fd00::5", 8000).url == "http://[fd00::5]:8000/metrics"
    assert ScrapeTarget("p", "127.1.0.7", 8000).url == "http://127.1.0.7:8000/metrics"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_replica(pod: str, handler: Handler) -> tuple[web.AppRunner, ScrapeTarget]:
    """A real HTTP server on loopback answering /metrics with `handler`; clean the runner up when done."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    await web.SockSite(runner, listener).start()
    return runner, ScrapeTarget(pod, "127.0.0.1", listener.getsockname()[1])


def test_scrapes_a_fleet_with_failing_replicas() -> None:
    asyncio.run(_scrape_fleet())


async def _scrape_fleet() -> None:
    ttft = {"sum": 2.0, "count": 10.0}

    async def healthy(_: web.Request) -> web.Response:
        return web.Response(
            text=(
                'kvfleet:num_requests_waiting{model_name="m"} 4\n'
                'kvfleet:num_requests_running{model_name="m"} 6\n'
                f'kvfleet:time_to_first_token_seconds_sum{{model_name="m"}} {ttft["sum"]}\n'
                f'kvfleet:time_to_first_token_seconds_count{{model_name="m"}} {ttft["count"]}\n'
            )
        )

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def no_queue_metrics(_: web.Request) -> web.Response:
        return web.Response(text="process_cpu_seconds_total 1\n")

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(text="kvfleet:num_requests_waiting 1\nkvfleet:num_requests_running 1\n")

    served = [
        await serve_replica(f"pod-{index}", handler)
        for index, handler in enumerate([healthy, broken, no_queue_metrics, slow])
    ]
    runners = [runner for runner, _ in served]
    targets = [target for _, target in served]
    targets.append(ScrapeTarget("pod-gone", "127.0.0.1", free_port()))
    try:
        async with aiohttp.ClientSession() as session:
            # Below the slow replica's second, with room for a loaded machine: at 0.3 s the healthy replica's
            # first answer missed it once in a full suite run.
            scraper = FleetScraper(session, timeout_seconds=0.6)
            first = await scraper.scrape(targets)
            assert isinstance(first[0], PodMetrics) and (first[0].waiting, first[0].running) == (4.0, 6.0)
            assert first[0].ttft_seconds is None, "a first scrape has no interval yet"
            no_answer, no_queue = ScrapeFailure.NO_ANSWER, ScrapeFailure.NO_QUEUE_METRICS
            assert first[1:] == [no_answer, no_queue, no_answer, no_answer]
            ttft["sum"], ttft["count"] = 3.5, 13.0
            second = await scraper.scrape(targets[:1])
            assert isinstance(second[0], PodMetrics) and second[0].ttft_seconds == 0.5
            ttft["sum"], ttft["count"] = 0.2, 1.0
            restarted = await scraper.scrape(targets[:1])
            assert isinstance(restarted[0], PodMetrics) and restarted[0].ttft_seconds is None

    finally:
        for runner in runners:
            await runner.cleanup()


def test_a_histogram_that_appears_later_counts_from_zero() -> None:
    asyncio.run(_late_histogram())


async def _late_histogram() -> None:
    page = {"text": "kvfleet:num_requests_waiting 0\nkvfleet:num_requests_running 0\n"}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page["text"])

    runner, target = await serve_replica("pod", metrics)
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=1)
            (first,) = await scraper.scrape([target])
            assert isinstance(first, PodMetrics) and first.ttft_seconds is None
            # A labelled histogram has no series until the replica's first request.
            page["text"] += (
                'kvfleet:time_to_first_token_seconds_sum{tier="standard"} 0.6\n'
                'kvfleet:time_to_first_token_seconds_count{tier="standard"} 2\n'
            )
            (second,) = await scraper.scrape([target])
            assert isinstance(second, PodMetrics) and second.ttft_seconds == pytest.approx(0.3)
    finally:
        await runner.cleanup()


def test_each_latency_is_a_mean_over_its_own_interval() -> None:
    asyncio.run(_two_latencies())


async def _two_latencies() -> None:
    counters = {"ttft": (1.0, 4.0), "itl": (2.0, 100.0), "prompt": 300.0}

    async def metrics(_: web.Request) -> web.Response:
        (ttft_sum, ttft_count), (itl_sum, itl_count) = counters["ttft"], counters["itl"]
        return web.Response(
            text=(
                "kvfleet:num_requests_waiting 0\nkvfleet:num_requests_running 3\n"
                f"kvfleet:{TTFT}_sum {ttft_sum}\nkvfleet:{TTFT}_count {ttft_count}\n"
                f"kvfleet:{ITL}_sum {itl_sum}\nkvfleet:{ITL}_count {itl_count}\n"
                f"{QUEUED_PROMPT_TOKENS} {counters['prompt']}\n"
            )
        )

    runner, target = await serve_replica("pod", metrics)
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=1)
            (first,) = await scraper.scrape([target])
            assert isinstance(first, PodMetrics) and first.queued_prompt_tokens == 300.0
            assert (first.ttft_seconds, first.itl_seconds) == (None, None), "no interval yet"
            # Two first tokens in 3 s; 50 output tokens 0.02 s apart.
            counters.update(ttft=(4.0, 6.0), itl=(3.0, 150.0), prompt=0.0)
            (second,) = await scraper.scrape([target])
            assert isinstance(second, PodMetrics) and second.queued_prompt_tokens == 0.0
            assert second.ttft_seconds == pytest.approx(1.5)
            assert second.itl_seconds == pytest.approx(0.02)
            # Only tokens between first tokens: the time to first token has no interval.
            counters.update(itl=(3.5, 160.0))
            (third,) = await scraper.scrape([target])
            assert isinstance(third, PodMetrics) and third.ttft_seconds is None
            assert third.itl_seconds == pytest.approx(0.05)
    finally:
        await runner.cleanup()


def test_a_page_over_the_cap_fails_and_the_other_replicas_still_report() -> None:
    asyncio.run(_capped_pages())


async def _capped_pages() -> None:
    cap = 64 * 1024
    line = 'kvfleet:num_requests_waiting{model_name="m"} 1\nkvfleet:num_requests_running{model_name="m"} 1\n'
    within = line * ((cap - 1) // len(line))
    over = line * (cap // len(line) + 1)

    async def declared_too_long(_: web.Request) -> web.Response:
        return web.Response(text=over)

    async def chunked_too_long(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, len(over), 4096):
            await response.write(over[start : start + 4096].encode())
        return response

    async def compressed_too_long(_: web.Request) -> web.Response:
        # A few KB on the wire: the cap counts what the page holds, not what was sent.
        response = web.Response(text=over * 16)
        response.enable_compression()
        return response

    async def just_within(_: web.Request) -> web.Response:
        return web.Response(text=within)

    served = [
        await serve_replica(f"pod-{index}", handler)
        for index, handler in enumerate(
            [declared_too_long, chunked_too_long, compressed_too_long, just_within]
        )
    ]
    runners = [runner for runner, _ in served]
    targets = [target for _, target in served]
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=10, max_page_bytes=cap)
            *too_large, fitting = await scraper.scrape(targets)
            assert too_large == [ScrapeFailure.PAGE_TOO_LARGE] * 3
            assert isinstance(fitting, PodMetrics) and fitting.waiting == within.count("waiting")
    finally:
        for runner in runners:
            await runner.cleanup()


SUPPORT = Path(__file__).parent / "support"
# What an uncapped scrape would hold of one endless answer: far past the allowance below.
ENDLESS_ANSWER_BYTES = 1 << 30
MEMORY_ALLOWANCE_KB = 100 * 1024
ENDLESS_ROUNDS = 20


def proc_status_kb(pid: int, field: str) -> int:
    """A memory figure (VmRSS, VmHWM) of a live process, in kB, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


def test_an_endless_page_is_cut_off_at_the_cap_and_memory_stays_flat() -> None:
    """The scrape path the operator runs, in its own process, against a replica whose /metrics never ends:
    every scrape of it fails as too large while the healthy replica next to it reports, and the process's
    peak RSS stays within 100 MB of what it was before."""
    server_command = [sys.executable, "-P", str(SUPPORT / "endless_metrics_server.py")]
    server = subprocess.Popen(
        [*server_command, f"--answer-bytes={ENDLESS_ANSWER_BYTES}", "--lifetime=600"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    scraper: subprocess.Popen[str] | None = None
    try:
        assert server.stdout is not None
        label, normal_port, endless_port = server.stdout.readline().split()
        assert label == "ports"
        options = [f"--normal-port={normal_port}", f"--endless-port={endless_port}", "--timeout=120"]
        scraper = subprocess.Popen(
            [sys.executable, "-P", str(SUPPORT / "scrape_loop.py"), *options, f"--scrapes={ENDLESS_ROUNDS}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert scraper.stdout is not None and scraper.stdin is not None
        assert scraper.stdout.readline().strip() == "baseline"
        baseline_kb = proc_status_kb(scraper.pid, "VmRSS")
        scraper.stdin.write("go\n")
        scraper.stdin.flush()
        rounds = []
        for line in scraper.stdout:
            if line.strip() == "done":
                break
            rounds.append(line.split())
        # The peak over the whole run, read while the process still lives.
        peak_kb = proc_status_kb(scraper.pid, "VmHWM")
        scraper.stdin.close()
        assert scraper.wait(timeout=30) == 0
        assert rounds == [["round", "metrics", "PAGE_TOO_LARGE"]] * ENDLESS_ROUNDS
        assert peak_kb < baseline_kb + MEMORY_ALLOWANCE_KB, (baseline_kb, peak_kb)
        output, _ = server.communicate(timeout=30)  # closes its stdin: it stops
        sent = [int(line.split()[1]) for line in output.splitlines() if line.startswith("sent ")]
        assert len(sent) == ENDLESS_ROUNDS
        # Each answer ended when the scraper hung up, not at the server's bound: it was never read whole.
        assert max(sent) < ENDLESS_ANSWER_BYTES // 16, sent
    finally:
        if scraper is not None:
            stop(scraper)
        stop(server)


def test_latency_buckets_are_read_per_interval_summed_over_label_sets() -> None:
    asyncio.run(_interval_buckets())


async def _interval_buckets() -> None:
    # A replica's own kind of page (prometheus_client, kvfleet's names, two tiers) is the page scraped; the
    # expected buckets are counted from the observations themselves.
    registry = CollectorRegistry()
    Gauge("kvfleet:num_requests_waiting", "", registry=registry).set(0)
    Gauge("kvfleet:num_requests_running", "", registry=registry).set(2)
    ttft = Histogram(f"kvfleet:{TTFT}", "", ["tier"], buckets=TTFT_BUCKETS, registry=registry)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    before, interval = [0.03, 0.3, 2.0], [0.05, 0.07, 0.2, 0.9, 700.0]
    for value in before:
        ttft.labels("standard").observe(value)
    runner, target = await serve_replica("pod", metrics)
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=1)
            (first,) = await scraper.scrape([target])
            assert isinstance(first, PodMetrics) and first.ttft_buckets is None, "no interval yet"
            for number, value in enumerate(interval):
                ttft.labels("standard" if number % 2 else "batch").observe(value)
            (second,) = await scraper.scrape([target])
    finally:
        await runner.cleanup()
    assert isinstance(second, PodMetrics) and second.itl_buckets is None
    expected = tuple(
        (bound, float(sum(value <= bound for value in interval))) for bound in (*TTFT_BUCKETS, math.inf)
    )
    assert second.ttft_buckets == expected


def test_token_counters_are_read_as_rates_between_scrapes() -> None:
    asyncio.run(_token_rates())


async def _token_rates() -> None:
    # kvfleet's counters summed over tiers; vLLM's alone on a vLLM pod.
    counters = {"prompt": (100.0, 50.0), "generated": 40.0}
    now = [0.0]

    async def metrics(_: web.Request) -> web.Response:
        standard, batch = counters["prompt"]
        return web.Response(
            text=(
                "kvfleet:num_requests_waiting 0\nkvfleet:num_requests_running 3\n"
                f'kvfleet:{PROMPT_TOKENS}_total{{tier="standard"}} {standard}\n'
                f'kvfleet:{PROMPT_TOKENS}_total{{tier="batch"}} {batch}\n'
                f"vllm:{GENERATION_TOKENS}_total {counters['generated']}\n"
            )
        )

    runner, target = await serve_replica("pod", metrics)
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=1, clock=lambda: now[0])
            (first,) = await scraper.scrape([target])
            assert isinstance(first, PodMetrics) and first.prompt_tokens_per_s is None, "no interval yet"
            # 2 s later: 450 more prompt tokens and 300 more generated.
            counters.update(prompt=(400.0, 200.0), generated=340.0)
            now[0] = 2.0
            (second,) = await scraper.scrape([target])
            assert isinstance(second, PodMetrics)
            assert (second.prompt_tokens_per_s, second.generation_tokens_per_s) == (225.0, 150.0)
            # A restart resets the counters: no rate across it.
            counters.update(prompt=(10.0, 0.0), generated=5.0)
            now[0] = 3.0
            (third,) = await scraper.scrape([target])
            assert isinstance(third, PodMetrics) and third.prompt_tokens_per_s is None
    finally:
        await runner.cleanup()
