"""The Service proxy: kube-proxy's job for ClusterIP Services, in userspace, on one asyncio loop in a thread.

Each ClusterIP Service's address (services.py) listens on each of its TCP ports; a connection goes to the
next of the Service's endpoints, round robin, at the port's target port, and bytes are relayed both ways
as they arrive (a server-sent event stream passes through unbuffered). An endpoint that refuses the
connection is passed over for the next; with no endpoint left the client's connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator

from .services import ObjectKey, Service, ServicePort

log = logging.getLogger("kvfleet.e2e.service_proxy")

RELAY_CHUNK_BYTES = 65536
CONNECT_TIMEOUT_SECONDS = 5.0
ListenerKey = tuple[str, int]  # (address, port)


class ServiceProxy:
    """`current(key)` is a Service as it is now: each connection picks from the endpoints of that moment."""

    def __init__(self, current: Callable[[ObjectKey], Service | None]) -> None:
        self._current = current
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service-proxy", daemon=True)
        # The Services as the listeners were last arranged for.
        self._services: dict[ObjectKey, Service] = {}
        self._listeners: dict[ListenerKey, asyncio.Server] = {}
        self._turns: dict[ListenerKey, Iterator[int]] = {}
        self._connections: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Closes every listener and connection, then ends the loop's thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def update(self, key: ObjectKey, service: Service | None) -> None:
        """From any thread: the Service as it is now (None: deleted); listeners follow when the loop runs."""
        self._loop.call_soon_threadsafe(self._apply, key, service)

    def _apply(self, key: ObjectKey, service: Service | None) -> None:
        old = self._services.pop(key, None)
        if service is not None:
            self._services[key] = service
        wanted = _listeners(service)
        for listener in _listeners(old) - wanted:
            server = self._listeners.pop(listener, None)
            if server is not None:  # else it is still being bound, and closes itself
                server.close()
            self._turns.pop(listener, None)
        for listener in wanted - _listeners(old):
            task = self._loop.create_task(self._listen(key, listener))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _listen(self, key: ObjectKey, listener: ListenerKey) -> None:
        address, port = listener

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._connections.add(task)
            try:
                await self._relay(key, port, reader, writer)
            finally:
                self._connections.discard(task)

        try:
            server = await asyncio.start_server(accept, address, port, reuse_address=True)
        except OSError as error:
            log.warning("service %s/%s cannot listen on %s:%d: %s", *key, address, port, error)
            return
        if self._services.get(key) is None or listener not in _listeners(self._services[key]):
            server.close()  # the Service changed while the socket was being bound
            return
        self._listeners[listener] = server

    async def _relay(
        self, key: ObjectKey, port: int, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        service = self._current(key)
        service_port = next((p for p in service.ports if p.port == port), None) if service else None
        upstream = None
        if service is not None and service_port is not None:
            upstream = await self._connect(service, service_port)
        if upstream is None:
            client.close()
            return
        upstream_reader, upstream_writer = upstream
        pipes = {
            asyncio.ensure_future(_pipe(client_reader, upstream_writer)),
            asyncio.ensure_future(_pipe(upstream_reader, client)),
        }
        try:
            # A half-close passes on and the other way goes on; a broken side ends both.
            _, unfinished = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            for pipe in unfinished:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for pipe in pipes:
                pipe.cancel()
            for writer in (client, upstream_writer):
                writer.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await writer.wait_closed()

    async def _connect(
        self, service: Service, port: ServicePort
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the next endpoint in turn that accepts one; None if none does."""
        targets = [(e.ip, t) for e in service.endpoints if (t := e.target_port(port)) is not None]
        if not targets:
            return None
        turn = self._turns.setdefault((service.address or "", port.port), itertools.count())
        first = next(turn)
        for offset in range(len(targets)):
            ip, target_port = targets[(first + offset) % len(targets)]
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                    return await asyncio.open_connection(ip, target_port)
            except (OSError, TimeoutError) as error:
                log.info(
                    "service %s/%s: endpoint %s:%d failed: %s",
                    service.namespace,
                    service.name,
                    ip,
                    target_port,
                    error,
                )
        return None

    async def _close_all(self) -> None:
        for server in self._listeners.values():
            server.close()
        self._listeners.clear()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)


def _listeners(service: Service | None) -> set[ListenerKey]:
    if service is None or service.address is None:
        return set()
    return {(service.address, port.port) for port in service.ports if port.protocol == "TCP"}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Relays until the reader's end, then half-closes the writer (the other way may go on)."""
    while chunk := await reader.read(RELAY_CHUNK_BYTES):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
