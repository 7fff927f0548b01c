"""The held requests' watch: while services are at zero it reads the gateways every poll and wakes the loop
of each service whose model has requests held; with none at zero it reads nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvfleet.operator.held_requests import HeldRequestWatch
from kvfleet.operator.scrape import GatewayQueue, ScrapeTarget

GATEWAYS = [ScrapeTarget("gateway-0", "10.0.0.1", 8000)]


def test_only_the_services_whose_model_has_held_requests_are_woken_and_only_while_watched() -> None:
    held = {"ns/a": 0.0, "ns/b": 2.0}
    reads: list[list[ScrapeTarget]] = []

    async def read(targets: Sequence[ScrapeTarget]) -> dict[str, GatewayQueue] | None:
        reads.append(list(targets))
        return {model: GatewayQueue(held=depth, routed=5.0) for model, depth in held.items()}

    async def scenario() -> None:
        watch = HeldRequestWatch(read, poll_seconds=0.01)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.05)
        assert reads == [], "no service at zero: the gateways are not read"
        a, b = asyncio.Event(), asyncio.Event()
        watch.watch(("ns", "a"), "ns/a", a, lambda: GATEWAYS)
        watch.watch(("ns", "b"), "ns/b", b, lambda: GATEWAYS)
        await asyncio.wait_for(b.wait(), 1)
        assert not a.is_set() and reads[0] == GATEWAYS
        held["ns/a"] = 1.0
        await asyncio.wait_for(a.wait(), 1)
        watch.watch(("ns", "a"), None, a, lambda: GATEWAYS)
        watch.watch(("ns", "b"), None, b, lambda: GATEWAYS)
        await asyncio.sleep(0.03)
        count = len(reads)
        await asyncio.sleep(0.05)
        assert len(reads) == count, "no read once no service is at zero"
        task.cancel()

    asyncio.run(scenario())
