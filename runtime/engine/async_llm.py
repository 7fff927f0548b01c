"""The engine as an API server process sees it: requests in, streams of outputs out, the core elsewhere.

- Tokenization and chat templates run on a small thread pool, never on the event loop, so a huge prompt
  cannot starve health checks or other requests' streams.
- Sequences go to the EngineCore process; its outputs come back one message per step and are turned into
  RequestOutputs here (detokenization, stop strings, n > 1), then routed to per-request asyncio queues.
- Requests that arrive before the engine is ready wait for it, up to the startup request timeout.
- If the core dies, every request in flight fails with EngineDeadError, and so does every later one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.engine.core_client import EngineCoreAddress, EngineCoreClient, EngineCoreProcess
from kvfleet.runtime.engine.messages import EngineCoreOutputs, EngineInfo
from kvfleet.runtime.engine.output_processor import OutputProcessor
from kvfleet.runtime.engine.outputs import OutputKind, RequestOutput
from kvfleet.runtime.engine.queue_limits import QueueLimits
from kvfleet.runtime.engine.sequences import ResumedSequence, sequence_ids, sequence_requests
from kvfleet.runtime.errors import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineShutdownError,
    InvalidRequestError,
    QueueLimitError,
    error_of_kind,
)
from kvfleet.runtime.generation_config import other_end_token_ids
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.metrics import RequestTracker, ServerMetrics
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.startup_phases import STARTUP_PHASES, process_age

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore
    from kvfleet.runtime.tracing import RequestTracing

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Threads that tokenize: enough that one huge prompt does not hold up every other request's.
_TOKENIZER_THREADS = 4


@dataclass
class _Stream:
    """The event loop's side of one request."""

    queue: asyncio.Queue[RequestOutput | BaseException]
    tier: str
    tracker: RequestTracker | None
    # What the request counts against the queue limits: its sequences, and its prompt's tokens until its
    # first output.
    num_sequences: int
    queued_tokens: int
    # A choice's tokens wait here until it has this many new ones (vLLM's stream interval); its first token
    # and its finish are handed out at once.
    interval: int = 1
    held: RequestOutput | None = None
    started: set[int] = field(default_factory=set)
    finished: bool = False

    def hand_out(self, output: RequestOutput) -> None:
        if self.interval == 1:
            self.queue.put_nowait(output)
            return
        if self.held is not None:
            output = self.held.followed_by(output)
        due, waiting = [], []
        for completion in output.outputs:
            first = bool(completion.token_ids) and completion.index not in self.started
            if output.finished or completion.finished or first:
                due.append(completion)
            else:
                (due if len(completion.token_ids) >= self.interval else waiting).append(completion)
        self.held = dataclasses.replace(output, outputs=waiting) if waiting else None
        if due or output.finished:
            self.started.update(completion.index for completion in due)
            self.queue.put_nowait(dataclasses.replace(output, outputs=due))


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        core_address: EngineCoreAddress | None = None,
        core_process: EngineCoreProcess | None = None,
        client_index: int = 0,
        api_server_count: int = 1,
        metrics: ServerMetrics | None = None,
        tracing: RequestTracing | None = None,
        tier_of: Callable[[int], str] = str,
        startup_request_timeout: float | None = None,
        core_class: type[EngineCore] | None = None,
        core_options: dict[str, Any] | None = None,
    ) -> None:
        """The engine stops `core_process` (started for it, so that the model loads while the server starts),
        or with neither that nor a `core_address`, its own EngineCore process, which it starts."""
        self.config = config
        self._core_address = core_process.address if core_process is not None else core_address
        self._client_index = client_index
        self._queue_limits = QueueLimits.share(config, api_server_count, client_index)
        self._metrics = metrics
        # Each request's span, ended with its metrics' observations (with metrics only).
        self._tracing = tracing
        self._tier_of = tier_of
        self.startup_request_timeout = startup_request_timeout
        self._core_class = core_class
        self._core_options = core_options
        self._core_process = core_process
        self._client: EngineCoreClient | None = None
        self._tokenizer_pool = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="kvfleet-tokenizer")
        self.tokenizer: Any = None
        self.output_processor: OutputProcessor | None = None
        self.info: EngineInfo | None = None
        self.eos_token_id: int | None = None
        self.other_end_token_ids: tuple[int, ...] = ()
        self._stats: SchedulerStats | None = None
        self._streams: dict[str, _Stream] = {}
        self._loaded = asyncio.Event()
        # Why the engine cannot serve: it failed to load, or its core died.
        self.error: EngineError | None = None
        # Set once the engine can no longer serve (and the process should exit).
        self.dead = asyncio.Event()
        if metrics is not None:
            metrics.set_stats_source(lambda: self._stats)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the tokenizer and connect to the core (starting it first if it is ours). Never raises: a
        failure leaves `error` set and `dead` set."""
        try:
            if self._core_address is None:
                self._core_process = await asyncio.to_thread(
                    EngineCoreProcess,
                    self.config,
                    core_class=self._core_class,
                    core_options=self._core_options,
                )
                self._core_address = self._core_process.address
            self._client = EngineCoreClient(
                self._core_address, self._client_index, self._on_outputs, self._on_dead, self._core_process
            )
            # The tokenizer loads while the core loads the model. Both are waited for, also when one fails:
            # nothing started here may outlive start().
            loading = asyncio.get_running_loop().run_in_executor(
                self._tokenizer_pool, _load_tokenizer, self.config
            )
            outcomes = await asyncio.gather(self._client.connect(), loading, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            ready, self.tokenizer = outcomes
            self.info = ready.info
            core_phases = ready.startup_phases
        except EngineError as exc:
            self.error = exc
        except Exception as exc:
            logger.exception("the engine failed to start")
            self.error = EngineDeadError(f"the engine failed to start: {type(exc).__name__}: {exc}")
        if self.error is None:
            info = self.info
            self.eos_token_id = self.tokenizer.eos_token_id
            self.other_end_token_ids = other_end_token_ids(
                self.config.generation_config, self.config.model, self.eos_token_id
            )
            self.output_processor = OutputProcessor(self.tokenizer)
            ready_seconds = process_age()
            logger.info("ready %.2f s after starting: %s", ready_seconds, STARTUP_PHASES.describe())
            if self._metrics is not None:
                self._metrics.set_engine_info(
                    attention_backend=info.attention_backend, device=info.device, dtype=info.dtype
                )
                self._metrics.set_startup(ready_seconds, lambda: {**core_phases, **STARTUP_PHASES.seconds})
        else:
            self.dead.set()
        self._loaded.set()

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.error is None

    @property
    def stats(self) -> SchedulerStats | None:
        return self._stats

    async def wait_ready(self, timeout: float | None) -> None:
        """Returns once the engine can serve; raises EngineNotReadyError after `timeout` seconds, or the
        error that keeps it from ever serving."""
        if not self._loaded.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self._loaded.wait()
            except TimeoutError:
                raise EngineNotReadyError(
                    "the model did not finish loading within the startup request timeout "
                    f"({self.startup_request_timeout:g} s)"
                ) from None
        if self.error is not None:
            raise self.error

    async def shutdown(self) -> None:
        """Fail what is still in flight, disconnect, and stop the core if this engine started it."""
        self.abort_all(lambda: EngineShutdownError("the server is shutting down"))
        if self._client is not None:
            await self._client.close()
        if self._core_process is not None:
            await asyncio.to_thread(self._core_process.stop)
        # Waits for a tokenization under way: nothing of the engine may outlive it.
        await asyncio.to_thread(self._tokenizer_pool.shutdown, wait=True, cancel_futures=True)

    # ---- tokenizer work (off the event loop) -----------------------------------------------------

    async def run_tokenizer(self, work: Callable[[Any], T]) -> T:
        """work(tokenizer), on the tokenizer threads."""
        await self.wait_ready(self.startup_request_timeout)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work, self.tokenizer)

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout: float | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        cache_salt: str | None = None,
        resumed: dict[int, ResumedSequence] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's delta outputs until the finished one; raises an EngineError when the
        request fails. Leaving the iteration early (the caller cancelled, the client gone) aborts the
        request, which frees its KV blocks before the core's next step. A continuation (`resumed`, by
        sequence index) first yields what its sequences had delivered (RequestOutput.resumed)."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        await self.wait_ready(self._remaining_startup_time(arrival))
        assert self._client is not None and self.output_processor is not None
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self._queue_limits is not None:
            self._check_queue_limits(self._queue_limits, params.n, priority)
        self.output_processor.add_request(
            request_id,
            None,
            prompt_token_ids,
            params,
            OutputKind.DELTA,
            sequence_ids(request_id, params.n),
            arrival,
            resumed,
        )
        stream = self._streams[request_id] = self._open_stream(
            request_id, len(prompt_token_ids), params, priority, lora_request, arrival
        )
        replay = self.output_processor.take_resumed(request_id)
        if replay is not None:
            if self._metrics is not None:
                self._metrics.record_resumed(stream.tier, _num_prefilled(resumed or {}))
            stream.hand_out(replay)
        if replay is not None and replay.finished:
            # Every sequence finished on the replica before: nothing is left to run.
            stream.finished = True
            self.output_processor.remove(request_id)
        else:
            self._client.add_requests(
                sequence_requests(
                    request_id,
                    prompt_token_ids,
                    params,
                    eos_token_id=self.eos_token_id,
                    other_end_token_ids=self.other_end_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    timeout=timeout,
                    lora_request=lora_request,
                    mm_features=mm_features,
                    cache_salt=cache_salt,
                    resumed=resumed,
                )
            )
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
                self._forget(request_id)

    def _check_queue_limits(self, limits: QueueLimits, n: int, priority: int) -> None:
        streams = self._streams.values()
        num_sequences = sum(stream.num_sequences for stream in streams)
        try:
            limits.check(num_sequences, sum(stream.queued_tokens for stream in streams), n)
        except QueueLimitError as error:
            if self._metrics is not None:
                self._metrics.record_rejected(error.limit, self._tier_of(priority))
            raise

    def _open_stream(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None,
        arrival: float,
    ) -> _Stream:
        tier = self._tier_of(priority)
        tracker = None
        if self._metrics is not None:
            lora_name = lora_request.lora_name if lora_request is not None else None
            span = self._tracing.start(request_id, params, arrival) if self._tracing is not None else None
            tracker = self._metrics.track(tier, num_prompt_tokens, lora_name, span)
        interval = max(params.stream_interval or 1, self.config.stream_interval)
        return _Stream(asyncio.Queue(), tier, tracker, params.n, num_prompt_tokens, interval)

    def _remaining_startup_time(self, arrival: float) -> float | None:
        if self.startup_request_timeout is None:
            return None
        return max(0.0, arrival + self.startup_request_timeout - time.monotonic())

    def abort(self, request_id: str, error: BaseException) -> None:
        """Stop a request from outside; its consumer receives `error`."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        stream.finished = True
        if stream.tracker is not None:
            stream.tracker.aborted()
        stream.queue.put_nowait(error)
        self._forget(request_id)

    def remove_lora(self, lora_int_id: int) -> None:
        """vLLM's: the engine drops the adapter's weights once the requests running with it end."""
        if self._client is not None:
            self._client.remove_lora(lora_int_id)

    def reset_prefix_cache(self) -> None:
        if self._client is not None:
            self._client.reset_prefix_cache()

    # ---- sleep mode (vLLM's; see EngineCore.sleep) ---------------------------------------------------

    async def sleep(self, level: int, mode: str) -> None:
        """Returns once the engine is asleep; raises the EngineError that kept it from sleeping."""
        await self.wait_ready(self.startup_request_timeout)
        assert self._client is not None
        await self._client.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> None:
        """Returns once the parts named (all of them by default) are taken back."""
        await self.wait_ready(self.startup_request_timeout)
        assert self._client is not None
        await self._client.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        """The engine sleeps, or still has a part asleep (a wake-up of some tags only)."""
        return self._stats is not None and self._stats.sleep_level > 0

    def abort_all(self, make_error: Callable[[], BaseException]) -> None:
        for request_id in list(self._streams):
            self.abort(request_id, make_error())

    def _forget(self, request_id: str) -> None:
        """Drop a request here and in the core (its sequences that are still running)."""
        if self.output_processor is None or self._client is None:
            return
        sequences = self.output_processor.sequence_ids(request_id)
        self.output_processor.remove(request_id)
        self._client.abort(sequences)

    # ---- from the core ---------------------------------------------------------------------------

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        self._stats = message.stats
        processor = self.output_processor
        if processor is None:
            return
        for sequence_id in message.started:
            processor.mark_scheduled(sequence_id, message.step_time)
        for error in message.errors:
            request_id = processor.request_of(error.request_id)
            if request_id is not None:
                self._fail(request_id, error_of_kind(error.kind, error.message))
        if not message.outputs:
            return
        outputs, stopped = processor.process(message.outputs, time.monotonic())
        if stopped and self._client is not None:
            self._client.abort(stopped)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.finished:
                continue
            if stream.tracker is not None:
                stream.tracker.observe(output)
            stream.queued_tokens = 0
            stream.finished = output.finished
            stream.hand_out(output)

    def _fail(self, request_id: str, error: EngineError) -> None:
        stream = self._streams.get(request_id)
        if isinstance(error, EngineOverloadedError) and self._metrics is not None and stream is not None:
            self._metrics.record_rejected(error.kind, stream.tier)
        if stream is not None and not stream.finished:
            stream.finished = True
            if stream.tracker is not None and not isinstance(error, EngineOverloadedError):
                stream.tracker.aborted()
            stream.queue.put_nowait(error)
        # The failed sequence is gone from the core; its siblings (n > 1) are stopped too.
        self._forget(request_id)

    def _on_dead(self, error: EngineDeadError) -> None:
        self.error = error
        self.abort_all(lambda: error)
        self.dead.set()


def _num_prefilled(resumed: dict[int, ResumedSequence]) -> int:
    """The resumed tokens a continuation computes again: those of its sequences still to run."""
    return sum(len(sequence.token_ids) for sequence in resumed.values() if not sequence.finished)


def _load_tokenizer(config: EngineConfig) -> Any:
    # Imported here, on a tokenizer thread: importing transformers takes seconds the event loop cannot spare.
    with STARTUP_PHASES.phase("tokenizer"):
        from kvfleet.runtime.tokenizer import load_tokenizer

        return load_tokenizer(config)
