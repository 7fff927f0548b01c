"""Runs the app under uvicorn with kvfleet's shutdown: SIGTERM drains instead of cutting requests off.

If the engine core fails to load or dies, requests in flight fail with a 500 naming the cause, /health
fails, and the process exits non-zero.

Drain: /ready turns false and new requests get 503 (the listener stays open so probes see it), requests
in flight run to completion for up to the drain timeout, the rest are then handed back, and the process
exits 0. A second SIGINT or SIGTERM exits at once.

The hand-back is a 503 with the code `draining`: a stream ends with it as an error event and [DONE] right
after the last token it sent. The fleet gateway takes that event as its cue to resume the request on another
replica from the tokens already sent, so behind it the drain timeout is only a grace for what is about to
end (the operator renders a short one); a client calling the replica directly sees the error, so a replica
on its own keeps a drain timeout as long as the generations it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Generator
from types import FrameType

import uvicorn
from kvfleet.contract.resume import DRAINING_CODE
from kvfleet.runtime.server.errors import ServiceUnavailableError
from kvfleet.runtime.server.state import ServerState
from kvfleet.runtime.server.tls import TlsFiles, refresh_on_change
from kvfleet.runtime.startup_phases import STARTUP_PHASES

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
# After the drain timeout, how long failed requests get to send their error before the process exits.
_ABORT_GRACE_S = 5.0
# Uvicorn's own wait for connections after the drain: only idle keep-alive ones are left by then.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, state: ServerState, refreshed_tls: TlsFiles | None = None
    ) -> None:
        """`refreshed_tls`: TLS files loaded again into the server's context whenever they change."""
        super().__init__(config)
        self.state = state
        self.refreshed_tls = refreshed_tls
        self.failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        self._spawn(self._exit_when_engine_dies())
        await super().serve(sockets)

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        with STARTUP_PHASES.phase("api_server_bind"):
            await super().startup(sockets)
        if self.refreshed_tls is not None and self.config.ssl is not None:
            self._spawn(refresh_on_change(self.refreshed_tls, self.config.ssl))

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Uvicorn's version re-raises the signal after shutting down, which would end the process with
        # the signal's status instead of 0 after a clean drain.
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining:
            logger.warning("second %s: exiting without waiting for requests", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        logger.info("%s: draining", signal.Signals(sig).name)
        self.state.draining = True
        # A signal handler may run in the middle of the event loop's own code: hand over, do nothing here.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._spawn, self._drain())

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        state = self.state
        deadline = time.monotonic() + state.settings.shutdown_timeout
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if state.in_flight:
            logger.warning(
                "drain timeout (%.1f s) passed with %d requests in flight; handing them back",
                state.settings.shutdown_timeout,
                state.in_flight,
            )
            state.engine.abort_all(
                lambda: ServiceUnavailableError(
                    "the server shut down before the request finished", code=DRAINING_CODE
                )
            )
            grace = time.monotonic() + _ABORT_GRACE_S
            while state.in_flight and time.monotonic() < grace:
                await asyncio.sleep(_DRAIN_POLL_S)
        logger.info("drained; shutting down")
        self.should_exit = True

    async def _exit_when_engine_dies(self) -> None:
        """A core that failed to load or died will not come back: the process exits non-zero, so that the
        pod restarts. Requests in flight have been failed; they get a moment to send their error."""
        engine = self.state.engine
        await engine.dead.wait()
        if engine.info is None:
            logger.error("the model could not be loaded: %s", engine.error)
        else:
            logger.error("exiting, the engine can no longer serve: %s", engine.error)
        self.failed = True
        grace = time.monotonic() + _ABORT_GRACE_S
        while self.state.in_flight and time.monotonic() < grace:
            await asyncio.sleep(_DRAIN_POLL_S)
        self.should_exit = True
