"""Lists and watches Kubernetes objects on the gateway's event loop, over aiohttp.

The API server's protocol: a list returns the objects and the resourceVersion they were read at; a watch
from that version streams one JSON event a line (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR) until the server
ends it at `timeoutSeconds`, and is resumed from the last version seen. A version the server no longer holds
is answered with 410 Gone (the response's status, or an ERROR event), and the objects are listed again.

Every failure is retried after an exponential backoff with full jitter, capped, so that gateways that lose
the API server together do not come back in step; a stream that delivers an event or runs to its end
resets it. Credentials and TLS come from the official client's configuration (a kubeconfig or the pod's
service account), whose refresh hook renews an expiring token before each request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from kubernetes import client
from kubernetes.client.rest import should_bypass_proxies

logger = logging.getLogger(__name__)

# The server ends each watch after this long; it is then resumed from the last version seen.
WATCH_SECONDS = 30
# A watch silent this long past its end is taken as a broken connection.
WATCH_SILENCE_SECONDS = WATCH_SECONDS + 30
REQUEST_SECONDS = 60.0
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 30.0

ObjectKey = tuple[str, str]
KubeObject = Mapping[str, Any]


class ApiError(Exception):
    """The API server refused a request; `status` is its HTTP status (or an ERROR event's code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


class Gone(ApiError):
    """410: the resourceVersion asked for is no longer held; the objects must be listed again."""


def api_error(status: int, message: str) -> ApiError:
    return Gone(status, message) if status == 410 else ApiError(status, message)


class Backoff:
    """Exponential backoff with full jitter: the n-th failure in a row waits a time drawn uniformly from
    [0, min(cap, base * 2**(n - 1))]; `reset` starts over from the base."""

    def __init__(
        self,
        base: float = BACKOFF_BASE_SECONDS,
        cap: float = BACKOFF_CAP_SECONDS,
        rng: random.Random | None = None,
    ) -> None:
        self.base = base
        self.cap = cap
        self._random = rng or random.Random()
        self._failures = 0

    def next_delay(self) -> float:
        bound = min(self.cap, self.base * 2**self._failures)
        if bound < self.cap:  # once capped, the exponent stops growing
            self._failures += 1
        return self._random.uniform(0, bound)

    def reset(self) -> None:
        self._failures = 0


class ApiServer:
    """GET requests to the API server with the configuration's address, credentials and TLS settings."""

    def __init__(self, configuration: client.Configuration, session: aiohttp.ClientSession) -> None:
        self._configuration = configuration
        self._session = session
        self._base = configuration.host.rstrip("/")
        bypass = should_bypass_proxies(configuration.host, configuration.no_proxy or "")
        self._proxy = configuration.proxy if configuration.proxy and not bypass else None

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
        async with self._request(path, params or {}, timeout) as response:
            return await response.json()

    @asynccontextmanager
    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[AsyncIterator[KubeObject]]:
        """The events of one watch, as the server sends them, until it ends the stream."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_SECONDS, sock_read=WATCH_SILENCE_SECONDS
        )
        async with (
            self._request(path, {**params, "watch": "true"}, timeout) as response,
            contextlib.aclosing(_events(response.content)) as events,
        ):
            yield events

    @asynccontextmanager
    async def _request(
        self, path: str, params: Mapping[str, str], timeout: aiohttp.ClientTimeout
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        # Reading the settings runs the refresh hook, which renews an expiring token; in a thread, as it may
        # run a kubeconfig's credential plugin.
        auth = await asyncio.to_thread(self._configuration.auth_settings)
        headers = {"Accept": "application/json"}
        headers.update({item["key"]: item["value"] for item in auth.values() if item["in"] == "header"})
        async with self._session.get(
            self._base + path,
            params=params,
            headers=headers,
            timeout=timeout,
            proxy=self._proxy,
            proxy_headers=self._configuration.proxy_headers,
            server_hostname=self._configuration.tls_server_name,
        ) as response:
            if response.status != 200:
                raise api_error(response.status, await _status_message(response))
            yield response


@asynccontextmanager
async def connect(configuration: client.Configuration) -> AsyncIterator[ApiServer]:
    """An ApiServer whose connections are closed on leaving."""
    connector = aiohttp.TCPConnector(ssl=_ssl_context(configuration), limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield ApiServer(configuration, session)


def _ssl_context(configuration: client.Configuration) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert, cadata=configuration.ca_cert_data)
    if not configuration.verify_ssl or configuration.assert_hostname is False:
        context.check_hostname = False
    if not configuration.verify_ssl:
        context.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context


async def _status_message(response: aiohttp.ClientResponse) -> str:
    """The message of the Status object the API server answers an error with, or the response's reason."""
    try:
        status = await response.json(content_type=None)
    except ValueError:
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message or response.reason or "")


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[KubeObject]:
    """The stream's events, one JSON object a line, however long (an object is as large as the server
    allows)."""
    pending = b""
    async for chunk in content.iter_any():
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            if line.strip():
                yield json.loads(line)
    if pending.strip():
        yield json.loads(pending)


def object_key(obj: KubeObject) -> ObjectKey:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


class ObjectWatch:
    """One collection (e.g. `/api/v1/namespaces/team/pods`) and what the cluster holds of it."""

    def __init__(self, path: str, label_selector: str | None = None) -> None:
        self.path = path
        self._selector = {"labelSelector": label_selector} if label_selector else {}
        self.store: dict[ObjectKey, KubeObject] = {}
        # Whether the store has been filled by a list at least once.
        self.synced = False
        # The version the store is current at; None: list again.
        self._version: str | None = None

    async def run(self, api: ApiServer, changed: Callable[[], None], backoff: Backoff | None = None) -> None:
        """Keeps `store` equal to the cluster's objects, calling `changed` after every change, until
        cancelled."""
        backoff = backoff or Backoff()
        while True:
            try:
                if self._version is None:
                    await self._list(api)
                    changed()
                await self._watch(api, changed, backoff)
            except Exception as error:  # any failure is retried, so the fleet is never left stale
                delay = backoff.next_delay()
                if isinstance(error, Gone):  # routine: the server has compacted the history watched from
                    self._version = None
                    logger.info("%s: %s; listing again in %.2f s", self.path, error, delay)
                else:
                    logger.warning("watching %s failed (%s); again in %.2f s", self.path, error, delay)
                await asyncio.sleep(delay)

    async def _list(self, api: ApiServer) -> None:
        listing = await api.get(self.path, self._selector)
        self.store = {object_key(item): item for item in listing.get("items") or []}
        self._version = listing["metadata"]["resourceVersion"]
        self.synced = True

    async def _watch(self, api: ApiServer, changed: Callable[[], None], backoff: Backoff) -> None:
        """Applies one stream's events, from the store's version, until the server ends it."""
        params = {
            **self._selector,
            "resourceVersion": str(self._version),
            "timeoutSeconds": str(WATCH_SECONDS),
            "allowWatchBookmarks": "true",
        }
        async with api.watch(self.path, params) as events:
            async for event in events:
                if self._apply(event):
                    changed()
                backoff.reset()
        backoff.reset()

    def _apply(self, event: KubeObject) -> bool:
        """Applies one event to the store; whether it changed the objects."""
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            raise api_error(int(obj.get("code") or 500), str(obj.get("message") or obj))
        self._version = obj["metadata"]["resourceVersion"]
        if kind == "BOOKMARK":
            return False
        if kind == "DELETED":
            self.store.pop(object_key(obj), None)
        else:
            self.store[object_key(obj)] = obj
        return True
