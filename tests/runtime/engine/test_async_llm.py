"""AsyncLLM with its EngineCore in a real process: streams, aborts, waiting for the model, a dead core."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLM
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.errors import EngineDeadError, EngineNotReadyError
from kvfleet.runtime.sampling_params import SamplingParams
from transformers import AutoModelForCausalLM

PROMPT = [5, 6, 7, 8]


def greedy_tokens(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """The oracle: Transformers' greedy continuation of the same folder."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _params(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _engine(model: Path, **options: Any) -> AsyncLLM:
    config = EngineConfig(model=str(model), num_gpu_blocks_override=256, max_model_len=512, dtype="float32")
    return AsyncLLM(config, **options)


def _run(engine: AsyncLLM, body: Callable[[AsyncLLM], Awaitable[Any]], *, start: bool = True) -> Any:
    async def main() -> Any:
        try:
            if start:
                await engine.start()
                assert engine.ready, engine.error
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def _tokens(engine: AsyncLLM, request_id: str, params: SamplingParams) -> list[list[int]]:
    sequences: list[list[int]] = [[] for _ in range(params.n)]
    async for output in engine.generate(request_id, PROMPT, params):
        for completion in output.outputs:
            sequences[completion.index].extend(completion.token_ids)
    return sequences


async def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def _long_request_under_way(engine: AsyncLLM) -> asyncio.Task[None]:
    """A 400-token request that has produced its first outputs."""
    outputs: list[RequestOutput] = []

    async def consume() -> None:
        async for output in engine.generate("long", PROMPT, _params(400)):
            outputs.append(output)

    task = asyncio.create_task(consume())
    await _until(lambda: len(outputs) >= 2)
    return task


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_concurrent_requests_match_transformers(tiny_llama: Path) -> None:
    expected = greedy_tokens(tiny_llama, PROMPT, 8)

    async def body(engine: AsyncLLM) -> list[list[list[int]]]:
        return await asyncio.gather(
            *(_tokens(engine, f"r{i}", _params(8)) for i in range(4)), _tokens(engine, "n2", _params(8, n=2))
        )

    results = _run(_engine(tiny_llama), body)
    assert results == [[expected]] * 4 + [[expected, expected]]


def test_abort_frees_blocks_and_the_idle_core_sleeps(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLM) -> None:
        task = await _long_request_under_way(engine)
        assert engine.stats is not None and engine.stats.kv_cache_usage > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _until(lambda: engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0)
        assert not engine._streams, "the request's stream outlived it"

        # With nothing to run, the core process waits on its socket instead of spinning.
        assert engine._core_address is not None
        pid = engine._core_address.pid
        before = _cpu_ticks(pid)
        await asyncio.sleep(1.0)
        assert _cpu_ticks(pid) - before <= 5, "the idle core used the CPU"
        # And it wakes up for the next request.
        assert len((await _tokens(engine, "next", _params(4)))[0]) == 4

    _run(_engine(tiny_llama), body)


def test_requests_sent_while_the_model_loads_wait_for_it(tiny_llama: Path) -> None:
    expected = greedy_tokens(tiny_llama, PROMPT, 4)

    async def body(engine: AsyncLLM) -> list[list[int]]:
        loader = asyncio.create_task(engine.start())
        await asyncio.sleep(0)
        assert not engine.ready
        tokens = await _tokens(engine, "early", _params(4))
        await loader
        return tokens

    assert _run(_engine(tiny_llama, startup_request_timeout=120), body, start=False) == [expected]


def test_a_request_waits_no_longer_than_the_startup_timeout(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLM) -> None:
        loader = asyncio.create_task(engine.start())
        with pytest.raises(EngineNotReadyError, match=r"startup request timeout \(0\.01 s\)"):
            await _tokens(engine, "early", _params(4))
        await loader

    _run(_engine(tiny_llama, startup_request_timeout=0.01), body, start=False)


def test_a_killed_core_fails_every_request_and_marks_the_engine_dead(tiny_llama: Path) -> None:
    async def body(engine: AsyncLLM) -> None:
        task = await _long_request_under_way(engine)
        assert engine._core_address is not None
        os.kill(engine._core_address.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"engine core process \(pid \d+\) was killed by SIGKILL"):
            await asyncio.wait_for(task, 10)
        assert engine.dead.is_set() and not engine.ready
        with pytest.raises(EngineDeadError):
            await _tokens(engine, "after", _params(4))

    _run(_engine(tiny_llama), body)


def test_a_core_that_cannot_load_the_model_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    async def body(engine: AsyncLLM) -> None:
        await engine.start()
        assert not engine.ready and engine.dead.is_set()
        assert isinstance(engine.error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await _tokens(engine, "r", _params(4))

    _run(_engine(tmp_path), body, start=False)


def test_the_core_starts_when_the_temporary_directory_has_a_long_path(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a container whose TMPDIR is a volume deep in the file system: longer than a socket path may be.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))

    async def body(engine: AsyncLLM) -> list[list[int]]:
        return await _tokens(engine, "r", _params(3))

    assert len(_run(_engine(tiny_llama), body)[0]) == 3
