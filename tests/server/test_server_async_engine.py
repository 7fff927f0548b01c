"""The async engine in-process on the tiny model: aborts, static batching, idling, load shedding."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.server.async_engine import AsyncLLMEngine
from kvfleet.runtime.server.errors import (
    ClientDisconnectedError,
    InternalServerError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvfleet.runtime.server.priorities import TIERS


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(model: Path, body: Callable[[AsyncLLMEngine], Awaitable[Any]], **options: Any) -> Any:
    engine_options = {"num_kv_blocks": 256, "max_model_len": 512, "dtype": "float32"}
    engine_options.update(
        {k: options.pop(k) for k in list(options) if k in EngineConfig.__dataclass_fields__}
    )
    config = EngineConfig(model=str(model), **engine_options)

    async def main() -> Any:
        engine = AsyncLLMEngine(config, metrics=ServerMetrics("tiny"), **options)
        engine.start()
        await engine.wait_loaded()
        assert engine.ready, engine.error
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def _collect(engine: AsyncLLMEngine, request_id: str, max_tokens: int, **kwargs: Any) -> list[float]:
    """Arrival times (monotonic) of each output of a request."""
    times = []
    async for _ in engine.generate(request_id, [5, 6, 7, 8], _params(max_tokens), **kwargs):
        times.append(time.monotonic())
    return times


def test_abort_frees_blocks_before_the_next_step(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        outputs: list[RequestOutput] = []

        async def consume() -> None:
            async for output in engine.generate("long", [5, 6, 7], _params(400)):
                outputs.append(output)

        task = asyncio.create_task(consume())
        await _until(lambda: len(outputs) >= 3)
        assert engine.stats.kv_cache_usage > 0
        steps_at_abort = engine.engine.num_steps
        engine.abort("long")
        await _until(lambda: engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0)
        # At most the step already running when the abort came.
        assert engine.engine.num_steps - steps_at_abort <= 1
        with pytest.raises(ClientDisconnectedError):
            await task
        assert not engine.engine.has_unfinished_requests()
        assert engine.num_in_flight == 0

        # Leaving the iteration early (what a cancelled handler does) aborts the request just the same.
        stream = engine.generate("left", [5, 6, 7], _params(400))
        async with contextlib.aclosing(stream):
            async for _ in stream:
                break
        await _until(lambda: not engine.engine.has_unfinished_requests())
        assert engine.stats.kv_cache_usage == 0

    _run(tiny_llama, body)


def test_engine_thread_sleeps_when_idle(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        await _collect(engine, "one", 4)
        steps = engine.engine.num_steps
        await asyncio.sleep(0.3)
        assert engine.engine.num_steps == steps
        # And wakes up for the next request.
        assert len(await _collect(engine, "two", 4)) == 4

    _run(tiny_llama, body)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "static"])
def test_static_batching_admits_the_next_batch_only_when_idle(tiny_llama: Path, continuous: bool) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        long_outputs: list[float] = []

        async def long(request_id: str) -> None:
            async for _ in engine.generate(request_id, [5, 6, 7, 8], _params(500)):
                long_outputs.append(time.monotonic())

        running = [asyncio.create_task(long("a")), asyncio.create_task(long("b"))]
        await _until(lambda: engine.stats.num_running == 2)
        late = asyncio.create_task(_collect(engine, "c", 3))
        if continuous:
            # Joins the running batch (there are free sequence slots) and is done while the long ones run.
            await late
            assert not any(task.done() for task in running)
        else:
            # Held back while the batch makes progress (20 steps), although there are free slots...
            progress = len(long_outputs) + 2 * 20
            await _until(lambda: len(long_outputs) >= progress)
            assert not late.done() and engine.stats.num_waiting == 1 and engine.stats.num_running == 2
        batch_ended = time.monotonic()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if not continuous:
            # ...and admitted once the engine is idle.
            assert (await late)[0] > batch_ended

    _run(tiny_llama, body, max_num_seqs=4, continuous_batching=continuous)


def test_static_batch_size_is_max_num_seqs(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLMEngine) -> list[list[float]]:
        return await asyncio.gather(*(_collect(engine, f"r{i}", 6) for i in range(5)))

    runs = _run(tiny_llama, body, max_num_seqs=2, continuous_batching=False)
    ends = sorted(run[-1] for run in runs)
    starts = sorted(run[0] for run in runs)
    # Three batches (2, 2, 1): each starts after the previous one has ended.
    assert starts[2] > ends[1] and starts[4] > ends[3]


def test_shedding_displaces_the_lowest_tier_first(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLMEngine) -> dict[str, Any]:
        results: dict[str, Any] = {}

        async def submit(request_id: str, tier: str, max_tokens: int) -> None:
            try:
                await _collect(engine, request_id, max_tokens, priority=TIERS[tier])
                results[request_id] = "done"
            except OverloadedError as exc:
                results[request_id] = exc.code

        # Runs for the whole test (it is cancelled at the end), so that everything else queues; critical, so
        # that no newcomer outranks it and takes its slot.
        running = asyncio.create_task(submit("running", "critical", 500))
        await _until(lambda: engine.stats.num_running == 1)
        queued = []
        for waiting, (request_id, tier) in enumerate((("batch-1", "batch"), ("batch-2", "batch")), start=1):
            queued.append(asyncio.create_task(submit(request_id, tier, 2)))
            await _until(lambda waiting=waiting: engine.stats.num_waiting == waiting)
        # The queue is full (2): each newcomer sheds the newest request of the lowest tier below its own.
        queued.append(asyncio.create_task(submit("standard", "standard", 2)))
        await _until(lambda: "batch-2" in results)
        await submit("batch-3", "batch", 2)
        queued.append(asyncio.create_task(submit("critical", "critical", 2)))
        await _until(lambda: "batch-1" in results)
        assert engine.stats.num_waiting == 2
        running.cancel()
        await asyncio.gather(*queued)
        return results

    results = _run(tiny_llama, body, max_num_seqs=1, max_waiting_requests=2, scheduling_policy="priority")
    assert results == {
        # The newest batch request gives way to the standard one...
        "batch-2": "shed",
        # ...a batch request cannot displace another batch request...
        "batch-3": "overloaded",
        # ...and critical displaces the remaining batch request, not the standard one.
        "batch-1": "shed",
        "standard": "done",
        "critical": "done",
    }


class _BrokenEngine:
    """Accepts requests, then fails its first step the way a bug would."""

    def __init__(self, config: EngineConfig) -> None:
        self.pending = False

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(int(self.pending), 0, 0, 0.0, 0, 0, 0)

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> list[int]:
        self.pending = True
        return []

    def abort_request(self, request_ids: str | list[str]) -> None:
        self.pending = False

    def has_unfinished_requests(self) -> bool:
        return self.pending

    def step(self) -> list[RequestOutput]:
        raise RuntimeError("scheduler bug")


def test_a_dead_engine_loop_fails_requests_and_turns_unhealthy(tmp_path: Path) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(tmp_path)), engine_factory=_BrokenEngine)
        engine.start()
        await engine.wait_loaded()
        assert engine.ready and engine.alive
        with pytest.raises(InternalServerError):
            async for _ in engine.generate("r", [1, 2], _params(4)):
                pass
        assert not engine.alive and not engine.ready
        with pytest.raises(ServiceUnavailableError):
            async for _ in engine.generate("s", [1, 2], _params(4)):
                pass
        await engine.shutdown()

    asyncio.run(main())


def test_an_engine_that_fails_to_load_is_reported(tmp_path: Path) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(tmp_path / "missing")))
        engine.start()
        await engine.wait_loaded()
        assert not engine.ready and not engine.alive and engine.error is not None
        await engine.shutdown()

    asyncio.run(main())
