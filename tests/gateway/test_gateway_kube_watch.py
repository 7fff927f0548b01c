"""The gateway's list and watch against a local HTTP server that speaks the API server's watch protocol:
it follows events from the list's version, lists again when that version is gone (410), waits between
failures with an exponential backoff with full jitter that is capped and starts over after a healthy
stream, and stops when cancelled."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from gateway_harness import WAIT_S, pod, service, wait_until
from kubernetes import client
from kvfleet.gateway.discovery import ClientKey, ModelConfig
from kvfleet.gateway.kube import KubernetesDiscovery
from kvfleet.gateway.kube_watch import Backoff, ObjectWatch, connect
from kvfleet.operator.api import API_KEY_ENV, GROUP, PLURAL, SERVICE_LABEL, VERSION

PODS = "/api/v1/namespaces/default/pods"
SERVICES = f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}"
DEFAULTS = ModelConfig(name="", endpoints=())
TOKEN = "Bearer watch-test-token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class WatchRequest:
    arrived: float
    params: dict[str, str]


@dataclass
class FakeApiServer:
    """One pod collection. Each watch request takes the next step of `script` (then "follow"):
    "refuse": 500 with a Status; "break": the connection drops before any event; "healthy": the events since
    the version asked for and a bookmark, then the stream ends as at its timeout; "follow": the events, then
    each new one, until `end_streams`. A version older than `oldest` is answered with 410, as an ERROR event
    or (with `gone_as_status`) as the response's status."""

    script: deque[str] = field(default_factory=deque)
    gone_as_status: bool = False
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 1
    oldest: int = 0
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    lists: list[int] = field(default_factory=list)
    watches: list[WatchRequest] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    open_streams: int = 0
    _generation: int = 0
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, obj: dict[str, Any], *, recorded: bool = True) -> None:
        self._change("MODIFIED" if obj["metadata"]["name"] in self.objects else "ADDED", obj, recorded)

    def delete(self, name: str, *, recorded: bool = True) -> None:
        self._change("DELETED", self.objects[name], recorded)

    def compact(self) -> None:
        """Forgets every event so far, as etcd's compaction does."""
        self.oldest = self.version
        self.history.clear()

    def end_streams(self) -> None:
        self._generation += 1
        self._wake()

    def _change(self, kind: str, obj: dict[str, Any], recorded: bool) -> None:
        self.version += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        if kind == "DELETED":
            del self.objects[obj["metadata"]["name"]]
        else:
            self.objects[obj["metadata"]["name"]] = obj
        if recorded:
            self.history.append((self.version, {"type": kind, "object": obj}))
        self._wake()

    def _wake(self) -> None:
        self.updated.set()
        self.updated = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("Authorization"))
        if request.query.get("watch") != "true":
            self.lists.append(self.version)
            metadata = {"resourceVersion": str(self.version)}
            return web.json_response(
                {"kind": "PodList", "metadata": metadata, "items": [*self.objects.values()]}
            )
        self.watches.append(WatchRequest(time.monotonic(), dict(request.query)))
        step = self.script.popleft() if self.script else "follow"
        since = int(request.query["resourceVersion"])
        if step == "refuse":
            return web.json_response(_status(500, "etcd is away"), status=500)
        if since < self.oldest and self.gone_as_status:
            return web.json_response(_status(410, "too old resource version"), status=410)
        response = web.StreamResponse()
        await response.prepare(request)
        if step == "break":
            assert request.transport is not None
            request.transport.abort()
        elif since < self.oldest:
            await _send(response, {"type": "ERROR", "object": _status(410, "too old resource version")})
        else:
            await self._stream(response, since, follow=step == "follow")
        return response

    async def _stream(self, response: web.StreamResponse, since: int, *, follow: bool) -> None:
        self.open_streams += 1
        generation = self._generation
        try:
            while True:
                for version, event in self.history:
                    if version > since:
                        await _send(response, event)
                        since = version
                if not follow or generation != self._generation:
                    break
                await self.updated.wait()
            if not follow:
                bookmark = {"kind": "Pod", "metadata": {"resourceVersion": str(self.version)}}
                await _send(response, {"type": "BOOKMARK", "object": bookmark})
            await response.write_eof()
        finally:
            self.open_streams -= 1


def _status(code: int, message: str) -> dict[str, Any]:
    return {"kind": "Status", "status": "Failure", "code": code, "message": message}


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


@asynccontextmanager
async def serving(
    server: FakeApiServer, routes: Mapping[str, Handler] | None = None
) -> AsyncIterator[client.Configuration]:
    """Serves `server` as the pods of the default namespace, and `routes`, on loopback; yields the client
    configuration that reaches them."""
    app = web.Application()
    app.router.add_get(PODS, server.handle)
    for path, handler in (routes or {}).items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.api_key = {"BearerToken": TOKEN}
    try:
        yield configuration
    finally:
        await runner.cleanup()


@asynccontextmanager
async def watching(
    configuration: client.Configuration, backoff: Backoff, watched: ObjectWatch
) -> AsyncIterator[asyncio.Task[None]]:
    async with connect(configuration) as api:
        task = asyncio.create_task(watched.run(api, lambda: None, backoff))
        try:
            yield task
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def replica(name: str) -> dict[str, Any]:
    obj = pod("chat", "10.0.0.1")
    obj["metadata"]["name"] = name
    return obj


def named(*names: str) -> dict[str, dict[str, Any]]:
    return {name: replica(name) for name in names}


def pod_names(watched: ObjectWatch) -> set[str]:
    return {name for _, name in watched.store}


class RecordedBackoff(Backoff):
    """The backoff itself, keeping the delays the watch asked it for."""

    def __init__(self, base: float, cap: float, rng: random.Random) -> None:
        super().__init__(base, cap, rng)
        self.delays: list[float] = []

    def next_delay(self) -> float:
        self.delays.append(super().next_delay())
        return self.delays[-1]


def full_jitter(rng: random.Random, base: float, cap: float, failures: int) -> list[float]:
    """The waits full jitter draws for `failures` failures in a row: uniform in [0, min(cap, base·2^n)]."""
    return [rng.uniform(0, min(cap, base * 2**n)) for n in range(failures)]


def waits(watches: list[WatchRequest]) -> list[float]:
    return [later.arrived - earlier.arrived for earlier, later in itertools.pairwise(watches)]


def test_the_backoff_draws_uniformly_below_a_bound_that_doubles_up_to_the_cap() -> None:
    base, cap, trials = 0.1, 2.0, 2000
    draws = []
    for seed in range(trials):
        backoff = Backoff(base, cap, random.Random(seed))
        draws.append([backoff.next_delay() for _ in range(8)])
    for failure in range(8):
        bound = min(cap, base * 2**failure)
        column = [row[failure] for row in draws]
        assert all(0 <= delay <= bound for delay in column), f"failure {failure + 1} waits at most {bound}"
        # Spread over the whole range, not the bound itself (a mean of 2000 uniform draws is within 2 % of
        # the middle by a margin of many standard deviations).
        assert min(column) < 0.05 * bound and max(column) > 0.95 * bound
        assert abs(sum(column) / trials - bound / 2) < 0.04 * bound


def test_a_reset_backoff_starts_again_from_the_base() -> None:
    base, cap = 0.1, 2.0
    for seed in range(200):
        backoff = Backoff(base, cap, random.Random(seed))
        for _ in range(10):
            backoff.next_delay()
        backoff.reset()
        after = [backoff.next_delay() for _ in range(3)]
        assert all(delay <= base * 2**n for n, delay in enumerate(after)), after


def test_a_watch_follows_the_events_after_the_lists_version() -> None:
    async def scenario() -> None:
        server = FakeApiServer(objects=named("a", "b"), version=7)
        watched = ObjectWatch(PODS)
        async with serving(server) as configuration, watching(configuration, Backoff(), watched):
            await wait_until(lambda: server.open_streams == 1)
            assert pod_names(watched) == {"a", "b"} and watched.synced
            assert server.watches[0].params["resourceVersion"] == "7", "from the list's version"
            server.put(replica("c"))
            server.delete("a")
            server.put({**server.objects["b"], "status": {"phase": "Failed"}})
            await wait_until(lambda: watched.store == {("default", n): o for n, o in server.objects.items()})
            assert server.lists == [7], "listed once"
            assert set(server.authorizations) == {TOKEN}

    asyncio.run(scenario())


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["error-event", "status"])
def test_a_version_the_server_no_longer_holds_is_listed_again(gone_as_status: bool) -> None:
    async def scenario() -> None:
        server = FakeApiServer(objects=named("a", "b"), gone_as_status=gone_as_status)
        watched = ObjectWatch(PODS)
        async with serving(server) as configuration, watching(configuration, Backoff(0.01, 0.1), watched):
            await wait_until(lambda: server.open_streams == 1)
            server.put(replica("c"))
            await wait_until(lambda: "c" in pod_names(watched))
            seen = server.version
            # Changes no watch reports: their events are compacted away before the watch is resumed.
            server.delete("b", recorded=False)
            server.put(replica("d"), recorded=False)
            server.compact()
            server.end_streams()
            await wait_until(lambda: len(server.lists) == 2 and server.open_streams == 1)
            assert pod_names(watched) == {"a", "c", "d"}
            resumed, relisted = server.watches[-2:]
            assert resumed.params["resourceVersion"] == str(seen), "resumed from the last event's version"
            assert relisted.params["resourceVersion"] == str(server.lists[1]), "then from the new list's"

    asyncio.run(scenario())


def test_failed_watches_are_retried_after_jittered_waits_that_stop_growing_at_the_cap() -> None:
    base, cap, failures, seed = 0.01, 0.05, 12, 3

    async def scenario() -> None:
        server = FakeApiServer(script=deque(["refuse", "break"] * (failures // 2)), objects=named("a"))
        backoff = RecordedBackoff(base, cap, random.Random(seed))
        async with serving(server) as configuration, watching(configuration, backoff, ObjectWatch(PODS)):
            await wait_until(lambda: server.open_streams == 1)
        assert backoff.delays == full_jitter(random.Random(seed), base, cap, failures)
        assert max(backoff.delays) <= cap
        for waited, delay in zip(waits(server.watches), backoff.delays, strict=True):
            assert waited >= delay
        assert server.lists == [server.lists[0]], "failures resume the watch; they do not list again"

    asyncio.run(scenario())


def test_a_healthy_stream_starts_the_backoff_over() -> None:
    base, cap, seed = 0.01, 0.1, 5

    async def scenario() -> None:
        script = deque(["refuse"] * 6 + ["healthy"] + ["refuse"] * 3)
        server = FakeApiServer(script=script, objects=named("a"))
        backoff = RecordedBackoff(base, cap, random.Random(seed))
        async with serving(server) as configuration, watching(configuration, backoff, ObjectWatch(PODS)):
            await wait_until(lambda: server.open_streams == 1)
        rng = random.Random(seed)
        assert backoff.delays == full_jitter(rng, base, cap, 6) + full_jitter(rng, base, cap, 3)
        gaps = waits(server.watches)
        assert len(gaps) == 6 + 1 + 3, "the healthy stream's end is followed by a watch at once"
        for waited, delay in zip(gaps[:6] + gaps[7:], backoff.delays, strict=True):
            assert waited >= delay

    asyncio.run(scenario())


def test_a_cancelled_watch_closes_its_stream() -> None:
    async def scenario() -> None:
        server = FakeApiServer(objects=named("a"))
        watched = ObjectWatch(PODS)
        async with serving(server) as configuration:
            async with watching(configuration, Backoff(), watched) as task:
                await wait_until(lambda: server.open_streams == 1)
            assert task.cancelled()
            await wait_until(lambda: server.open_streams == 0)

    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


def test_the_discovery_publishes_each_service_with_its_ready_pods_and_key() -> None:
    async def scenario() -> None:
        chat = service("chat", engine={"apiKeySecret": "chat-key"})
        services = FakeApiServer(objects={"chat": chat})
        pods = FakeApiServer(objects={"first": pod("chat", "10.0.0.1")})
        key = b"a key"

        async def secret(request: web.Request) -> web.Response:
            return web.json_response({"data": {API_KEY_ENV: base64.b64encode(key).decode()}})

        published: list[Mapping[str, ModelConfig]] = []
        routes = {SERVICES: services.handle, "/api/v1/namespaces/default/secrets/chat-key": secret}
        async with serving(pods, routes) as configuration:
            discovery = KubernetesDiscovery(configuration, ["default"], DEFAULTS)
            task = asyncio.create_task(discovery.run(published.append))
            await wait_until(lambda: published and published[-1]["default/chat"].endpoints)
            model = published[-1]["default/chat"]
            assert model.endpoints == ("http://10.0.0.1:8000",)
            assert model.client_key == ClientKey(hashlib.sha256(key).digest())
            assert pods.watches[0].params["labelSelector"] == SERVICE_LABEL
            pods.put(pod("chat", "10.0.0.2"))
            await wait_until(lambda: len(published[-1]["default/chat"].endpoints) == 2)
            await wait_until(lambda: services.open_streams == pods.open_streams == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: services.open_streams == pods.open_streams == 0)

    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


def test_the_discovery_stops_when_cancelled_as_a_change_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cancellation lands in the step in which a watch reports a change, the moment the discovery's wait
    # for one ends: a wait that returned the change then would leave the discovery running.
    async def scenario() -> None:
        services = FakeApiServer(objects={"chat": service("chat")})
        pods = FakeApiServer(objects={"first": pod("chat", "10.0.0.1")})
        published: list[Mapping[str, ModelConfig]] = []
        report_change, cancel_on_change = asyncio.Event.set, asyncio.Event()

        def report_change_and_cancel(event: asyncio.Event) -> None:
            report_change(event)
            if cancel_on_change.is_set() and event not in (services.updated, pods.updated):
                task.cancel()

        # Before the discovery makes its event, whose `set` the watches take when they start.
        monkeypatch.setattr(asyncio.Event, "set", report_change_and_cancel)
        async with serving(pods, {SERVICES: services.handle}) as configuration:
            discovery = KubernetesDiscovery(configuration, ["default"], DEFAULTS)
            task = asyncio.create_task(discovery.run(published.append))
            await wait_until(lambda: published and services.open_streams == pods.open_streams == 1)
            report_change(cancel_on_change)
            pods.put(pod("chat", "10.0.0.2"))
            done, _ = await asyncio.wait([task], timeout=WAIT_S / 2)
            if not done:
                task.cancel()  # again, so that the servers can stop
            with pytest.raises(asyncio.CancelledError):
                await task
            assert done, "the discovery went on after its cancellation"

    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
