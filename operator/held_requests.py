"""Wakes the loop of a service at zero as soon as the gateway holds a request for it.

A service's loop reads the requests the gateway holds with its replicas' metrics, once per
metricsIntervalSeconds (2 s by default); at zero, that interval is time a request waking the service waits
before a replica is even asked for. While some service is at zero, this watch reads the gateway replicas every
POLL_SECONDS instead and wakes the loop of each such service whose model has requests held.

The operator polls rather than the gateway pushing: it already finds and reads the gateway replicas, so
nothing new needs an address or credentials, a change of the operator's leader loses nothing, a read that
fails is made good by the next, and one read of the gateways serves every service at zero. No read is made
while none is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from kvfleet.operator.scrape import GatewayQueue, ScrapeTarget

# A held request reaches its service's loop within this (and the gateway's answer).
POLL_SECONDS = 0.2

ServiceKey = tuple[str, str]
# The gateway replicas to read, as the operator's watch of their pods knows them now.
GatewayTargets = Callable[[], Sequence[ScrapeTarget]]
# The gateways' queue per model (GatewayQueues.read); None when none answered.
GatewayRead = Callable[[Sequence[ScrapeTarget]], Awaitable[dict[str, GatewayQueue] | None]]


class HeldRequestWatch:
    def __init__(self, read: GatewayRead, poll_seconds: float = POLL_SECONDS) -> None:
        self._read = read
        self._poll_seconds = poll_seconds
        # Service -> the model the gateway holds its requests under, and its loop's wakeup.
        self._watched: dict[ServiceKey, tuple[str, asyncio.Event]] = {}
        self._gateways: GatewayTargets = tuple
        self._watching = asyncio.Event()

    def watch(
        self, service: ServiceKey, model: str | None, wakeup: asyncio.Event, gateways: GatewayTargets
    ) -> None:
        """Sets `wakeup` whenever the gateways hold requests for `model`; None: the service is no longer at
        zero (or is gone), and is not watched."""
        if model is None:
            self._watched.pop(service, None)
            return
        self._watched[service] = (model, wakeup)
        self._gateways = gateways
        self._watching.set()

    async def run(self) -> None:
        while True:
            if not self._watched:
                self._watching.clear()
                await self._watching.wait()
            targets = self._gateways()
            queues = await self._read(targets) if targets else None
            for model, wakeup in list(self._watched.values()):
                if queues is not None and model in queues and queues[model].held > 0:
                    wakeup.set()
            await asyncio.sleep(self._poll_seconds)
