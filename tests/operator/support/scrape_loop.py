"""The operator's scrape path in a process of its own, so a test can watch its memory from outside.

    scrape_loop.py --normal-port P --endless-port Q --scrapes N --timeout S [--max-page-bytes B]

Scrapes a normal replica a few times (the warm-up), prints `baseline` and waits for a line on stdin; then
scrapes both replicas together N times, printing `round NORMAL ENDLESS` with each one's outcome (`metrics` or
the failure), prints `done` and exits when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
from kvfleet.operator.api import FIELD_MANAGER
from kvfleet.operator.autoscaler import PodMetrics
from kvfleet.operator.scrape import DEFAULT_MAX_PAGE_BYTES, FleetScraper, ScrapeFailure, ScrapeTarget

WARM_UP_SCRAPES = 3


def outcome(result: PodMetrics | ScrapeFailure) -> str:
    return "metrics" if isinstance(result, PodMetrics) else result.name


async def scrape(options: argparse.Namespace) -> None:
    normal = ScrapeTarget("normal-0", "127.0.0.1", options.normal_port)
    endless = ScrapeTarget("endless-0", "127.0.0.1", options.endless_port)
    # As the operator's startup handler makes its session and each service loop its scraper.
    async with aiohttp.ClientSession(headers={"User-Agent": FIELD_MANAGER}) as session:
        scraper = FleetScraper(session, options.timeout, options.max_page_bytes)
        for _ in range(WARM_UP_SCRAPES):
            (result,) = await scraper.scrape([normal])
            assert isinstance(result, PodMetrics), result
        print("baseline", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        for _ in range(options.scrapes):
            results = await scraper.scrape([normal, endless])
            print("round", *(outcome(result) for result in results), flush=True)
    print("done", flush=True)
    await asyncio.to_thread(sys.stdin.read)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--normal-port", type=int, required=True)
    parser.add_argument("--endless-port", type=int, required=True)
    parser.add_argument("--scrapes", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--max-page-bytes", type=int, default=DEFAULT_MAX_PAGE_BYTES)
    asyncio.run(scrape(parser.parse_args()))


if __name__ == "__main__":
    main()
