"""The operator reads what the gateways hold: its GatewayQueues against real gateways' /metrics pages."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
from gateway_harness import WAIT_S, model, queued, running_gateway, wait_until
from kvfleet.operator.scrape import GatewayQueue, GatewayQueues, ScrapeTarget


def test_the_operator_sums_the_requests_every_gateway_holds_per_model() -> None:
    async def hold(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"{url}/v1/chat/completions", json=body) as answer:
                await answer.read()

    async def scenario() -> None:
        models = {"cold": model("cold", hold_seconds=WAIT_S), "warm": model("warm", "http://127.0.0.1:9")}
        async with (
            running_gateway(models) as (first, _, first_url),
            running_gateway(models) as (second, _, url),
        ):
            held = [
                asyncio.create_task(hold(first_url)),
                asyncio.create_task(hold(url)),
                asyncio.create_task(hold(url)),
            ]
            await wait_until(lambda: queued(first, "cold") == 1)
            await wait_until(lambda: queued(second, "cold") == 2)
            targets = [
                ScrapeTarget(f"gateway-{index}", urlsplit(base).hostname or "", urlsplit(base).port or 0)
                for index, base in enumerate((first_url, url))
            ]
            async with aiohttp.ClientSession() as session:
                queues = GatewayQueues(session, timeout_seconds=WAIT_S)
                # The three wait for a replica of a model with none yet: each also counts as having waited.
                expected = {"cold": GatewayQueue(held=3.0, waited=3.0), "warm": GatewayQueue()}
                assert await queues.read(targets) == expected
                gone = [ScrapeTarget("gateway-gone", "127.0.0.1", 9)]
                assert await GatewayQueues(session, timeout_seconds=WAIT_S).read(gone) is None
            for task in held:
                task.cancel()

    asyncio.run(scenario())
