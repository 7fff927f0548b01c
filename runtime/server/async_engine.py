"""The engine behind the HTTP server: a dedicated thread steps the synchronous LLMEngine; asyncio awaits.

Why a thread: a step is one model forward, during which torch releases the GIL, so the event loop keeps
accepting, parsing and streaming while the model runs, and no step ever waits for the event loop.

- Adds and aborts are commands on a thread-safe queue that the engine thread applies between steps, so
  the engine itself is only ever touched by that thread.
- After each step the thread hands all outputs of the step to the event loop in one
  `call_soon_threadsafe`, which routes them into per-request asyncio queues.
- With nothing to do the thread sleeps on a condition variable; a new command wakes it. It never spins.
- Load shedding is decided on the engine thread at admission, where the queue depth is exact.
- With continuous batching off, new requests are held back until the engine is idle and then admitted
  together, up to max_num_seqs: the static batching that continuous batching is measured against.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.engine.outputs import OutputKind, RequestOutput
from kvfleet.runtime.metrics import RequestTracker, ServerMetrics
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.server.errors import (
    BadRequestError,
    ClientDisconnectedError,
    InternalServerError,
    OverloadedError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from kvfleet.runtime.server.load_shedding import QueuedRequest, choose_victim
from kvfleet.runtime.server.priorities import tier_of

logger = logging.getLogger(__name__)

_THREAD_JOIN_TIMEOUT_S = 30.0


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    timeout: float | None
    arrival_time: float

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.arrival_time + self.timeout


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stream:
    """The event loop's side of one request."""

    queue: asyncio.Queue[RequestOutput | BaseException]
    tier: str
    tracker: RequestTracker | None
    finished: bool = False


@dataclass
class _EngineThreadState:
    """Touched only by the engine thread."""

    # Requests held back while a static batch runs, in arrival order.
    pending: list[_Add] = field(default_factory=list)
    # Admitted requests that have produced nothing yet: the ones load shedding may displace.
    unstarted: dict[str, _Add] = field(default_factory=dict)


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        continuous_batching: bool = True,
        max_waiting_requests: int | None = None,
        metrics: ServerMetrics | None = None,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        self.config = config
        self.continuous_batching = continuous_batching
        self.max_waiting_requests = max_waiting_requests
        self._metrics = metrics
        self._engine_factory = engine_factory or _load_engine
        # Set once, by the engine thread, before `ready` is.
        self.engine: Any = None

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._thread_state = _EngineThreadState()
        self._latest_stats: SchedulerStats | None = None

        self._streams: dict[str, _Stream] = {}
        self._ready = asyncio.Event()
        self._loaded = asyncio.Event()
        self.error: BaseException | None = None
        if metrics is not None:
            metrics.set_stats_source(lambda: self._latest_stats)

    # ---- lifecycle (event loop) ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model, then steps. Call from the event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> None:
        """Returns when the engine is ready or has failed to load (then `error` says why)."""
        await self._loaded.wait()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    @property
    def alive(self) -> bool:
        """False once the engine failed to load or its loop died: the process should be restarted."""
        return self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def stats(self) -> SchedulerStats | None:
        return self._latest_stats

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight are failed."""
        self.abort_all(lambda: ServiceUnavailableError("the server is shutting down", code="shutting_down"))
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, _THREAD_JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", _THREAD_JOIN_TIMEOUT_S)

    # ---- requests (event loop) -------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout: float | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's delta outputs until the finished one; raises an OpenAIError on rejection.

        Leaving the iteration early (the caller's task cancelled, the client gone) aborts the request, which
        frees its KV blocks before the engine's next step.
        """
        if not self.ready:
            raise ServiceUnavailableError("the model is not loaded", code="not_ready")
        if request_id in self._streams:
            raise BadRequestError(f"request id {request_id!r} is already in use")
        tier = tier_of(priority)
        tracker = self._metrics.track(tier, len(prompt_token_ids)) if self._metrics is not None else None
        stream = _Stream(asyncio.Queue(), tier, tracker)
        self._streams[request_id] = stream
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._submit(_Add(request_id, prompt_token_ids, params, priority, timeout, arrival))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None and not stream.finished:
                stream.finished = True
                if stream.tracker is not None:
                    stream.tracker.aborted()
                self._submit(_Abort(request_id))

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Stop a request from outside; its consumer receives `error` (client disconnect by default)."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        stream.finished = True
        if stream.tracker is not None:
            stream.tracker.aborted()
        stream.queue.put_nowait(error or ClientDisconnectedError(request_id))
        self._submit(_Abort(request_id))

    def abort_all(self, make_error: Callable[[], BaseException]) -> None:
        for request_id in list(self._streams):
            self.abort(request_id, make_error())

    def _submit(self, command: _Add | _Abort) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def _deliver(self, deliveries: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in deliveries:
            stream = self._streams.get(request_id)
            if stream is None or stream.finished:
                continue
            if isinstance(item, RequestOutput):
                if stream.tracker is not None:
                    stream.tracker.observe(item)
                stream.finished = item.finished
            else:
                stream.finished = True
                if isinstance(item, OverloadedError) and self._metrics is not None:
                    self._metrics.record_rejected(item.code or "overloaded", stream.tier)
            stream.queue.put_nowait(item)

    def _on_loaded(self, error: BaseException | None) -> None:
        self.error = error
        if error is None:
            self._ready.set()
        self._loaded.set()

    def _on_died(self, error: BaseException) -> None:
        self.error = error
        self.abort_all(lambda: InternalServerError("the engine stopped after an internal error"))

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # A closed event loop means the process is exiting and nobody waits for this any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)

    # ---- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._engine_factory(self.config)
        except BaseException as exc:
            logger.exception("the engine failed to load")
            self._call_soon(self._on_loaded, exc)
            return
        self.engine = engine
        self._latest_stats = engine.stats
        if self._metrics is not None:
            runner = engine.runner
            self._metrics.set_engine_info(
                attention_backend=runner.attention_backend.name,
                device=runner.device.type,
                dtype=str(runner.dtype).removeprefix("torch."),
            )
        self._call_soon(self._on_loaded, None)
        try:
            self._step_loop(engine)
        except BaseException as exc:
            logger.exception("the engine loop failed; failing every request in flight")
            self._call_soon(self._on_died, exc)

    def _step_loop(self, engine: Any) -> None:
        state = self._thread_state
        while True:
            with self._wakeup:
                while not (
                    self._commands or self._stopping or state.pending or engine.has_unfinished_requests()
                ):
                    self._wakeup.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            deliveries: list[tuple[str, RequestOutput | BaseException]] = []
            for command in commands:
                if isinstance(command, _Add):
                    self._admit(engine, command, deliveries)
                else:
                    self._drop(engine, command.request_id)
            if state.pending:
                self._expire_pending(deliveries)
                if not engine.has_unfinished_requests():
                    self._release_static_batch(engine, deliveries)
            if engine.has_unfinished_requests():
                for output in engine.step():
                    state.unstarted.pop(output.request_id, None)
                    deliveries.append((output.request_id, output))
            self._latest_stats = self._current_stats(engine)
            if deliveries:
                self._call_soon(self._deliver, deliveries)

    def _current_stats(self, engine: Any) -> SchedulerStats:
        stats = engine.stats
        held = sum(add.params.n for add in self._thread_state.pending)
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + held) if held else stats

    def _admit(
        self, engine: Any, add: _Add, deliveries: list[tuple[str, RequestOutput | BaseException]]
    ) -> None:
        state = self._thread_state
        limit = self.max_waiting_requests
        if limit is not None and self._current_stats(engine).num_waiting >= limit:
            queued = [
                QueuedRequest(a.request_id, a.priority, a.arrival_time) for a in state.unstarted.values()
            ]
            victim = choose_victim(queued, add.priority)
            if victim is None:
                deliveries.append(
                    (
                        add.request_id,
                        OverloadedError(f"the server is overloaded: {limit} requests are waiting"),
                    )
                )
                return
            self._drop(engine, victim)
            deliveries.append(
                (
                    victim,
                    OverloadedError("the server is overloaded: a higher tier took this place", code="shed"),
                )
            )
        state.unstarted[add.request_id] = add
        if self.continuous_batching:
            self._add_to_engine(engine, add, deliveries)
        else:
            state.pending.append(add)

    def _add_to_engine(
        self, engine: Any, add: _Add, deliveries: list[tuple[str, RequestOutput | BaseException]]
    ) -> None:
        try:
            engine.add_request(
                add.request_id,
                add.prompt_token_ids,
                add.params,
                priority=add.priority,
                timeout=add.timeout,
                output_kind=OutputKind.DELTA,
                arrival_time=add.arrival_time,
                prompt_token_ids=add.prompt_token_ids,
            )
        except ValueError as exc:
            self._thread_state.unstarted.pop(add.request_id, None)
            deliveries.append((add.request_id, BadRequestError(str(exc))))

    def _drop(self, engine: Any, request_id: str) -> None:
        state = self._thread_state
        state.unstarted.pop(request_id, None)
        held = [add for add in state.pending if add.request_id == request_id]
        if held:
            state.pending.remove(held[0])
        else:
            engine.abort_request(request_id)

    def _expire_pending(self, deliveries: list[tuple[str, RequestOutput | BaseException]]) -> None:
        state = self._thread_state
        now = time.monotonic()
        expired = [add for add in state.pending if add.deadline is not None and add.deadline <= now]
        for add in expired:
            state.pending.remove(add)
            state.unstarted.pop(add.request_id, None)
            deliveries.append(
                (add.request_id, RequestTimeoutError("the request timed out before it started"))
            )

    def _release_static_batch(
        self, engine: Any, deliveries: list[tuple[str, RequestOutput | BaseException]]
    ) -> None:
        state = self._thread_state
        order = state.pending
        if self.config.scheduling_policy == "priority":
            order = sorted(order, key=lambda add: (add.priority, add.arrival_time))
        batch: list[_Add] = []
        num_seqs = 0
        for add in order:
            if batch and num_seqs + add.params.n > self.config.max_num_seqs:
                break
            batch.append(add)
            num_seqs += add.params.n
        released = {add.request_id for add in batch}
        state.pending = [add for add in state.pending if add.request_id not in released]
        for add in batch:
            self._add_to_engine(engine, add, deliveries)


def _load_engine(config: EngineConfig) -> Any:
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    return LLMEngine(config)
