"""Scraping replicas' /metrics: the text format, name fallback, TTFT intervals, and failing replicas."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web
from kvfleet.operator.scrape import FleetScraper, ScrapeTarget, parse_exposition

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
    assert (page.ttft_sum, page.ttft_count) == (2.0, 10.0)


def test_falls_back_to_vllm_names_and_sums_label_sets() -> None:
    page = parse_exposition(VLLM_PAGE)
    assert (page.waiting, page.running, page.kv_cache_usage) == (3.0, 4.0, 0.5)
    assert page.ttft_sum is None and page.ttft_count is None


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


def test_ipv6_targets_are_bracketed() -> None:
    assert ScrapeTarget("p", "fd00::5", 8000).url == "http://[fd00::5]:8000/metrics"
    assert ScrapeTarget("p", "127.1.0.7", 8000).url == "http://127.1.0.7:8000/metrics"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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

    runners = []
    targets = []
    for index, handler in enumerate([healthy, broken, no_queue_metrics, slow]):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        await web.SockSite(runner, listener).start()
        runners.append(runner)
        targets.append(ScrapeTarget(f"pod-{index}", "127.0.0.1", listener.getsockname()[1]))
    targets.append(ScrapeTarget("pod-gone", "127.0.0.1", _free_port()))
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=0.3)
            first = await scraper.scrape(targets)
            assert first[0] is not None and (first[0].waiting, first[0].running) == (4.0, 6.0)
            assert first[0].ttft_seconds is None, "a first scrape has no interval yet"
            assert first[1:] == [None, None, None, None]
            ttft["sum"], ttft["count"] = 3.5, 13.0
            second = await scraper.scrape(targets[:1])
            assert second[0] is not None and second[0].ttft_seconds == 0.5
            ttft["sum"], ttft["count"] = 0.2, 1.0
            restarted = await scraper.scrape(targets[:1])
            assert restarted[0] is not None and restarted[0].ttft_seconds is None

    finally:
        for runner in runners:
            await runner.cleanup()


def test_a_histogram_that_appears_later_counts_from_zero() -> None:
    asyncio.run(_late_histogram())


async def _late_histogram() -> None:
    page = {"text": "kvfleet:num_requests_waiting 0\nkvfleet:num_requests_running 0\n"}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    await web.SockSite(runner, listener).start()
    target = ScrapeTarget("pod", "127.0.0.1", listener.getsockname()[1])
    try:
        async with aiohttp.ClientSession() as session:
            scraper = FleetScraper(session, timeout_seconds=1)
            (first,) = await scraper.scrape([target])
            assert first is not None and first.ttft_seconds is None
            # A labelled histogram has no series until the replica's first request.
            page["text"] += (
                'kvfleet:time_to_first_token_seconds_sum{tier="standard"} 0.6\n'
                'kvfleet:time_to_first_token_seconds_count{tier="standard"} 2\n'
            )
            (second,) = await scraper.scrape([target])
            assert second is not None and second.ttft_seconds == pytest.approx(0.3)
    finally:
        await runner.cleanup()
