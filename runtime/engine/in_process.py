"""An EngineClient over an LLMEngine that runs the EngineCore in this process: `kvfleet run-batch` answers
lines with the OpenAI service the server uses, without HTTP and without a second process.

Only the stepping task touches the LLMEngine: requests added or aborted from the event loop are queued and
applied between steps, while a step itself runs on a thread so that tokenization goes on beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.messages import EngineInfo
from kvfleet.runtime.engine.outputs import OutputKind, RequestOutput
from kvfleet.runtime.engine.sequences import ResumedSequence
from kvfleet.runtime.errors import EngineDeadError, EngineError, InvalidRequestError
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TOKENIZER_THREADS = 2


class InProcessEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer: Any = engine.tokenizer
        self.info: EngineInfo = engine.engine_core.info
        # The engine is loaded before any request arrives, and never waits for it.
        self.error: EngineError | None = None
        self.startup_request_timeout: float | None = None
        self._tokenizer_pool = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="kvfleet-tokenizer")
        self._changes: list[Callable[[], None]] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wake = asyncio.Event()
        self._stepping: asyncio.Task[None] | None = None
        self.output_tokens = 0

    async def __aenter__(self) -> InProcessEngine:
        self._stepping = asyncio.create_task(self._step_forever())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._stepping is not None
        self._stepping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._stepping
        self._tokenizer_pool.shutdown(wait=True, cancel_futures=True)

    async def wait_ready(self, timeout: float | None) -> None:
        if self.error is not None:
            raise self.error

    async def run_tokenizer(self, work: Callable[[Any], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work, self.tokenizer)

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
        """The request's delta outputs until the finished one; leaving early aborts it."""
        await self.wait_ready(None)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        arrival = time.monotonic() if arrival_time is None else arrival_time

        def add() -> None:
            try:
                self.engine.add_request(
                    request_id,
                    prompt_token_ids,
                    params,
                    priority=priority,
                    timeout=timeout,
                    output_kind=OutputKind.DELTA,
                    arrival_time=arrival,
                    prompt_token_ids=prompt_token_ids,
                    lora_request=lora_request,
                    mm_features=mm_features,
                    cache_salt=cache_salt,
                    resumed=resumed,
                )
            except InvalidRequestError as exc:
                queue.put_nowait(exc)
                return
            except ValueError as exc:
                queue.put_nowait(InvalidRequestError(str(exc)))
                return
            replay = self.engine.output_processor.take_resumed(request_id)
            if replay is not None:
                queue.put_nowait(replay)
                if replay.finished:  # nothing is left to run
                    self.engine.abort_request(request_id)

        self._change(add)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._change(lambda: self.engine.abort_request(request_id))

    def abort(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def remove_lora(self, lora_int_id: int) -> None:
        self._change(lambda: self.engine.remove_lora(lora_int_id))

    def reset_prefix_cache(self) -> None:
        self._change(self.engine.reset_prefix_cache)

    def _change(self, change: Callable[[], None]) -> None:
        self._changes.append(change)
        self._wake.set()

    async def _step_forever(self) -> None:
        try:
            while True:
                changes, self._changes = self._changes, []
                for change in changes:
                    change()
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    if not self._changes:
                        await self._wake.wait()
                    continue
                for output in await asyncio.to_thread(self.engine.step):
                    self.output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Nothing more can run: every waiting request fails with the cause, and so does every later one.
            logger.exception("the engine failed")
            self.error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            for queue in self._queues.values():
                queue.put_nowait(self.error)
