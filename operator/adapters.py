"""An InferenceService's LoRA adapters in its running replicas. With spec.engine.allowRuntimeLoraUpdates they
are loaded and unloaded through the runtime's own API (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), so changing them never restarts a pod; without it they are the replicas' flags and
are only read here.

Each pass reads what every ready replica serves from its /v1/models (an adapter's card gives the digest of
its source, never the source itself), unloads what the spec no longer lists or lists from another source,
and loads what is missing. An adapter that a replica refused is tried again only after RETRY_SECONDS: a bad
adapter must not cost a load on every pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
from kvfleet.operator.scrape import ScrapeTarget, read_capped
from kvfleet.runtime.lora.request import source_digest

AdapterState = Literal["Pending", "Loading", "Ready", "Failed"]
RETRY_SECONDS = 60.0
# /v1/models of a replica lists the base model and its adapters: small, but capped all the same.
MAX_MODELS_PAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class DesiredAdapter:
    name: str
    # What the runtime is asked to load: a path inside the pod, or an hf:// URI it fetches itself.
    source: str


@dataclass(frozen=True)
class AdapterStatus:
    name: str
    state: AdapterState
    ready_replicas: int
    message: str = ""


class AdapterLoadError(Exception):
    """The replica refused the adapter (a 4xx); the message is the runtime's reason."""


class ReplicaUnavailable(Exception):
    """The replica did not answer, or answered what no runtime would."""


class ReplicaAdapters(Protocol):
    async def served(self, target: ScrapeTarget, api_key: str | None) -> dict[str, str]:
        """Adapter name -> source_digest() of what the replica serves; raises ReplicaUnavailable."""
        ...

    async def load(self, target: ScrapeTarget, adapter: DesiredAdapter, api_key: str | None) -> None: ...

    async def unload(self, target: ScrapeTarget, name: str, api_key: str | None) -> None: ...


class RuntimeAdapterClient:
    """ReplicaAdapters over the runtime's HTTP API."""

    def __init__(self, session: aiohttp.ClientSession, timeout_seconds: float = 120.0) -> None:
        self._session = session
        # Loading reads and checks the adapter's weights (and may fetch them from the hub first).
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def served(self, target: ScrapeTarget, api_key: str | None) -> dict[str, str]:
        body = await self._call("GET", target, "/v1/models", None, api_key)
        try:
            cards = body["data"]
            return {card["id"]: card["source_digest"] for card in cards if card.get("parent") is not None}
        except (KeyError, TypeError) as error:
            raise ReplicaUnavailable(f"{target.pod}: /v1/models is not a model list") from error

    async def load(self, target: ScrapeTarget, adapter: DesiredAdapter, api_key: str | None) -> None:
        body = {"lora_name": adapter.name, "lora_path": adapter.source}
        await self._call("POST", target, "/v1/load_lora_adapter", body, api_key)

    async def unload(self, target: ScrapeTarget, name: str, api_key: str | None) -> None:
        # A 404 says it is already gone: what this call wanted.
        with contextlib.suppress(AdapterLoadError):
            await self._call("POST", target, "/v1/unload_lora_adapter", {"lora_name": name}, api_key)

    async def _call(
        self, method: str, target: ScrapeTarget, path: str, body: dict[str, Any] | None, api_key: str | None
    ) -> Any:
        url = f"{target.base_url}{path}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            async with self._session.request(
                method, url, json=body, headers=headers, timeout=self._timeout
            ) as response:
                raw = await read_capped(response, MAX_MODELS_PAGE_BYTES)
                if raw is None:
                    raise ReplicaUnavailable(f"{target.pod}: {path} answered more than the operator reads")
                text = raw.decode("utf-8", "replace")
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ReplicaUnavailable(f"{target.pod}: {path} did not answer: {error}") from error
        if status in (401, 403):
            raise ReplicaUnavailable(
                f"{target.pod}: {path} refused the operator (HTTP {status}): {_error_message(text)}"
            )
        if 400 <= status < 500:
            raise AdapterLoadError(_error_message(text) or f"HTTP {status}")
        if status != 200:
            raise ReplicaUnavailable(f"{target.pod}: {path} answered HTTP {status}: {_error_message(text)}")
        try:
            return json.loads(text) if method == "GET" else None
        except ValueError as error:
            raise ReplicaUnavailable(f"{target.pod}: {path} answered no JSON") from error


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:500]


@dataclass
class AdapterSync:
    client: ReplicaAdapters
    clock: Callable[[], float] = time.monotonic
    # (name, source) -> (the replica's reason, when it was refused).
    _refused: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)

    async def sync(
        self,
        desired: Sequence[DesiredAdapter],
        targets: Sequence[ScrapeTarget],
        api_key: str | None,
        *,
        update: bool,
    ) -> list[AdapterStatus]:
        """Converges every ready replica on `desired`, or with `update` off (replicas that serve their
        adapters from their flags) only reads what they serve; each desired adapter's state afterwards."""
        outcomes = await asyncio.gather(*(self._converge(t, desired, api_key, update) for t in targets))
        answered = [names for names in outcomes if isinstance(names, set)]
        problems = [problem for problem in outcomes if isinstance(problem, str)]
        wanted = {(adapter.name, adapter.source) for adapter in desired}
        self._refused = {key: value for key, value in self._refused.items() if key in wanted}
        return [self._status(adapter, answered, len(targets), problems) for adapter in desired]

    async def _converge(
        self, target: ScrapeTarget, desired: Sequence[DesiredAdapter], api_key: str | None, update: bool
    ) -> set[str] | str:
        """The names the replica serves from the wanted source once done, or why it could not be asked."""
        try:
            served = await self.client.served(target, api_key)
            wanted = {adapter.name: source_digest(adapter.source) for adapter in desired}
            if not update:
                return {name for name, source in served.items() if wanted.get(name) == source}
            for name, source in served.items():
                if wanted.get(name) != source:
                    await self.client.unload(target, name, api_key)
            ready = {name for name, source in served.items() if wanted.get(name) == source}
            for adapter in desired:
                if adapter.name in ready or self._refused_recently(adapter):
                    continue
                try:
                    await self.client.load(target, adapter, api_key)
                except AdapterLoadError as error:
                    self._refused[(adapter.name, adapter.source)] = (str(error), self.clock())
                    continue
                self._refused.pop((adapter.name, adapter.source), None)
                ready.add(adapter.name)
        except ReplicaUnavailable as error:
            return str(error)
        return ready

    def _refused_recently(self, adapter: DesiredAdapter) -> bool:
        refused = self._refused.get((adapter.name, adapter.source))
        return refused is not None and self.clock() - refused[1] < RETRY_SECONDS

    def _status(
        self, adapter: DesiredAdapter, answered: list[set[str]], replicas: int, problems: list[str]
    ) -> AdapterStatus:
        ready = sum(1 for names in answered if adapter.name in names)
        refused = self._refused.get((adapter.name, adapter.source))
        if refused is not None and ready < replicas:
            return AdapterStatus(adapter.name, "Failed", ready, refused[0])
        if replicas == 0:
            return AdapterStatus(adapter.name, "Pending", 0, "no replica is ready")
        if ready == replicas:
            return AdapterStatus(adapter.name, "Ready", ready)
        message = f"served by {ready} of {replicas} ready replicas"
        return AdapterStatus(adapter.name, "Loading", ready, "; ".join([message, *problems[:1]]))
