"""Which LoRA adapters each replica serves, and each one's lora_int_id there, learnt by polling the replicas'
/metrics.

A replica lists its adapters in two places: `/v1/models` (each with its `parent`) and the
`kvfleet:lora_adapter_info` series of `/metrics`, one per adapter name, with its lora_int_id (the seed of the
adapter's prefix-cache block hashes) as a label; a replica that gives none (vLLM's) serves the adapter, and
the gateway cannot hash its prompts' blocks. The gateway reads /metrics: it needs
no API key, whereas /v1/models does on a replica started with one, and the gateway holds no key to send (it
knows only the digests of the services' keys, to check each client's own). A replica that does not answer
keeps the adapters last learnt from it until discovery removes it; one that answers without the series serves
none.

A page is read line by line within a deadline and up to a byte cap, and only the adapter series' lines are
kept: whatever a replica answers, a poll holds at most that much.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from kvfleet.contract.metrics import LORA_ADAPTER_INFO, LORA_INT_ID_LABEL, LORA_NAME_LABEL
from kvfleet.gateway.flow import AdapterIds, Fleet
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

DEFAULT_ADAPTER_POLL_SECONDS = 2.0
# A replica's /metrics page is rendered at once; a slower answer is one from a replica in trouble.
POLL_TIMEOUT_S = 2.0
# A replica's page with every SLA tier in use is about 150 KB, and each adapter adds about 530 B.
MAX_METRICS_BYTES = 4 * 1024 * 1024


def adapter_ids(metrics_text: str) -> AdapterIds:
    """The adapters a replica's /metrics page lists: each one's lora_int_id by name (None where the page
    gives none, or not a positive integer)."""
    return {
        sample.labels[LORA_NAME_LABEL]: _lora_int_id(sample.labels.get(LORA_INT_ID_LABEL))
        for family in text_string_to_metric_families(metrics_text)
        if family.name == LORA_ADAPTER_INFO
        for sample in family.samples
        if LORA_NAME_LABEL in sample.labels
    }


def _lora_int_id(label: str | None) -> int | None:
    if label is None or not label.isdigit():
        return None
    value = int(label)
    return value if value > 0 else None


async def poll_adapters(fleet: Fleet, session: aiohttp.ClientSession, interval: float) -> None:
    """Asks every replica of the fleet for its adapters every `interval` seconds, until cancelled."""
    while True:
        urls = fleet.replica_urls()
        found = await asyncio.gather(*(_adapters_of(session, url) for url in urls))
        fleet.update_adapters(
            {url: names for url, names in zip(urls, found, strict=True) if names is not None}
        )
        await asyncio.sleep(interval)


async def _adapters_of(session: aiohttp.ClientSession, url: str) -> AdapterIds | None:
    """None when the replica cannot say."""
    try:
        # Identity encoding: the gateway's session passes bodies through undecoded.
        async with session.get(
            f"{url}/metrics",
            headers={"Accept-Encoding": "identity"},
            timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S),
        ) as response:
            if response.status != 200:
                logger.info("%s/metrics answered %d; its adapters stay as last learnt", url, response.status)
                return None
            return adapter_ids(await _adapter_lines(response, url))
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        logger.info("could not read the adapters of %s (%s); they stay as last learnt", url, error)
        return None


async def _adapter_lines(response: aiohttp.ClientResponse, url: str) -> str:
    """The adapter series' lines of a /metrics page, read as they arrive; ValueError past the byte cap (or a
    line longer than the reader's buffer), when the connection is closed unread."""
    kept: list[str] = []
    read = 0
    while line := await response.content.readline():
        read += len(line)
        if read > MAX_METRICS_BYTES:
            response.close()
            raise ValueError(f"{url}/metrics is larger than {MAX_METRICS_BYTES} bytes")
        if line.startswith(LORA_ADAPTER_INFO.encode()):
            kept.append(line.decode())  # the text format is UTF-8
    return "".join(kept)
