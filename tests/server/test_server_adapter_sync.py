"""The operator's adapter sync against a real `kvfleet serve` replica: what it loads is then served under the
adapter's name (checked through the openai SDK), what it drops is unloaded, and a replica's refusal becomes
the adapter's Failed state with the runtime's own reason."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import aiohttp
import openai
import pytest
from kvfleet.operator.adapters import AdapterStatus, AdapterSync, DesiredAdapter, RuntimeAdapterClient
from kvfleet.operator.scrape import ScrapeTarget
from kvfleet.runtime.lora.make_adapter import make_adapter
from kvfleet.runtime.lora.request import source_digest

if TYPE_CHECKING:
    from servers import ServerProcess


def _sync(
    server: ServerProcess, desired: list[DesiredAdapter], api_key: str | None, *, update: bool = True
) -> list[AdapterStatus]:
    address = urlparse(server.url)
    target = ScrapeTarget("replica-0", address.hostname or "", address.port or 0)

    async def run() -> list[AdapterStatus]:
        async with aiohttp.ClientSession() as session:
            sync = AdapterSync(RuntimeAdapterClient(session))
            return await sync.sync(desired, [target], api_key, update=update)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def replica(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        "--enable-lora", "--max-lora-rank", "16", "--allow-runtime-lora-updates", api_key="replica-key"
    )


def test_sync_loads_unloads_and_reports_refusals(
    replica: ServerProcess, tiny_llama: Path, tmp_path: Path
) -> None:
    first = DesiredAdapter("first", str(make_adapter(tiny_llama, tmp_path / "first", rank=8, seed=1)))
    second = DesiredAdapter("second", str(make_adapter(tiny_llama, tmp_path / "second", rank=4, seed=2)))
    too_big = DesiredAdapter("too-big", str(make_adapter(tiny_llama, tmp_path / "big", rank=32, seed=3)))
    client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="replica-key", max_retries=0, timeout=60)

    def served() -> set[str]:
        return {model.id for model in client.models.list().data}

    assert _sync(replica, [first, second], "replica-key") == [
        AdapterStatus("first", "Ready", 1),
        AdapterStatus("second", "Ready", 1),
    ]
    assert served() == {"tiny", "first", "second"}
    completion = client.completions.create(model="second", prompt=[5, 6, 7], max_tokens=2)
    assert completion.model == "second"

    statuses = _sync(replica, [second, too_big], "replica-key")
    assert statuses[0] == AdapterStatus("second", "Ready", 1)
    assert statuses[1].state == "Failed" and "--max-lora-rank" in statuses[1].message
    assert served() == {"tiny", "second"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="first", prompt=[5, 6, 7], max_tokens=2)

    # Another source under the same name replaces the adapter.
    moved = DesiredAdapter("second", first.source)
    assert _sync(replica, [moved], "replica-key") == [AdapterStatus("second", "Ready", 1)]
    cards = {model.id: model for model in client.models.list().data}
    assert cards["second"].model_extra["source_digest"] == source_digest(first.source)
    assert first.source not in client.models.list().model_dump_json(), "clients see no adapter path"

    # Replicas that serve their adapters from flags are only read.
    unloaded = DesiredAdapter("unloaded", second.source)
    assert _sync(replica, [moved, unloaded], "replica-key", update=False) == [
        AdapterStatus("second", "Ready", 1),
        AdapterStatus("unloaded", "Loading", 0, "served by 0 of 1 ready replicas"),
    ]
    assert served() == {"tiny", "second"}

    wrong_key = _sync(replica, [moved], "not-the-key")
    assert wrong_key[0].state == "Loading" and "HTTP 401" in wrong_key[0].message
