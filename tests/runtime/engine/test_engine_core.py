"""The EngineCore in-process on the tiny model: aborts, shedding, per-request failures, static batching."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvfleet.runtime.bench.static_batching import StaticBatchingEngineCore
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import SchedulerOutput
from kvfleet.runtime.engine.core import EngineCore
from kvfleet.runtime.engine.messages import AddRequest, EngineCoreOutputs
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = [5, 6, 7, 8]


def _core(model: Path, core_class: type[EngineCore] = EngineCore, **options: Any) -> EngineCore:
    engine_options = {"num_gpu_blocks_override": 256, "max_model_len": 512, "dtype": "float32"}
    engine_options.update(
        {k: options.pop(k) for k in list(options) if k in EngineConfig.__dataclass_fields__}
    )
    return core_class(EngineConfig(model=str(model), **engine_options), **options)


def _add(
    request_id: str, max_tokens: int, *, priority: int = 0, prompt: list[int] = PROMPT, **params: Any
) -> AddRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return AddRequest(
        request_id, prompt, sampling, eos_token_id=None, arrival_time=time.monotonic(), priority=priority
    )


def _run_to_end(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, tuple[str, str]]]:
    """Tokens of every request and the errors (kind, message), stepping until nothing is left."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, tuple[str, str]] = {}
    while core.has_unfinished_requests():
        step = core.step()
        for output in step.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        errors.update({e.request_id: (e.kind, e.message) for e in step.errors})
    return tokens, errors


def test_abort_frees_blocks_at_once(tiny_llama: Path) -> None:
    core = _core(tiny_llama)
    core.add_request(_add("long", 400))
    for _ in range(3):
        core.step()
    assert core.scheduler.stats.kv_cache_usage > 0
    core.abort_requests(["long", "unknown"])
    assert core.scheduler.stats.kv_cache_usage == 0
    assert not core.has_unfinished_requests()


def test_bad_requests_are_answered_alone(tiny_llama: Path) -> None:
    core = _core(tiny_llama)
    core.add_request(_add("good", 4))
    core.add_request(_add("outside", 4, prompt=[1, 10**9]))
    core.add_request(_add("too-long", 4, prompt=[1] * 512))
    tokens, errors = _run_to_end(core)
    assert len(tokens["good"]) == 4
    assert errors["outside"][0] == "invalid" and "vocabulary" in errors["outside"][1]
    assert errors["too-long"][0] == "invalid" and "context" in errors["too-long"][1]


def test_a_refused_request_leaves_nothing_behind(tiny_llama: Path) -> None:
    """A request refused after its grammar was given to it (its id is taken) is answered once; that grammar
    having failed to compile touches nothing, and the request holding the id runs on."""
    core = _core(tiny_llama)
    broken = StructuredOutputsParams(grammar='root ::= "a" undefined')
    core.add_request(_add("first", 6, structured_outputs=broken))
    _, errors = _run_to_end(core)
    assert errors["first"][0] == "invalid"  # the compiler now holds the failure, given at once from here on
    core.add_request(_add("taken", 6))
    core.add_request(_add("taken", 6, structured_outputs=broken))
    tokens: list[int] = []
    answers = []
    while core.has_unfinished_requests():
        step = core.step()
        tokens += [t for output in step.outputs for t in output.new_token_ids]
        answers += [(e.request_id, e.kind, e.message) for e in step.errors]
    assert answers == [("taken", "invalid", "request id 'taken' is already in use")]
    assert len(tokens) == 6


def test_a_request_that_fails_the_step_fails_alone(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _core(tiny_llama)
    for index in range(3):
        reference.add_request(_add(f"good-{index}", 12, prompt=[5 + index, 6, 7]))
    expected, _ = _run_to_end(reference)

    core = _core(tiny_llama)
    execute: Callable[[SchedulerOutput], Any] = core.executor.execute_model

    def fail_with_the_poisoned_request(scheduler_output: SchedulerOutput) -> Any:
        if any(request.request_id == "poisoned" for request in scheduler_output.requests):
            raise RuntimeError("poisoned input")
        return execute(scheduler_output)

    monkeypatch.setattr(core.executor, "execute_model", fail_with_the_poisoned_request)
    for index in range(3):
        core.add_request(_add(f"good-{index}", 12, prompt=[5 + index, 6, 7]))
    core.add_request(_add("poisoned", 12))
    tokens, errors = _run_to_end(core)
    assert errors == {
        "poisoned": ("failed", "the engine failed while running this request: RuntimeError: poisoned input")
    }
    # The others ran in the batch with it, and still produced exactly their tokens.
    assert {rid: ids for rid, ids in tokens.items() if rid != "poisoned"} == expected
    assert core.scheduler.stats.kv_cache_usage == 0


def test_shedding_displaces_the_lowest_tier_first(tiny_llama: Path) -> None:
    critical, standard, batch = 0, 2, 3
    core = _core(tiny_llama, max_num_seqs=1, max_waiting_requests=2, scheduling_policy="priority")
    core.add_request(_add("running", 500, priority=critical))
    core.step()
    errors: dict[str, str] = {}

    def add(request_id: str, priority: int) -> None:
        core.add_request(_add(request_id, 2, priority=priority))
        errors.update({e.request_id: e.kind for e in core.step().errors})

    add("batch-1", batch)
    add("batch-2", batch)
    assert core.scheduler.stats.num_waiting == 2 and not errors
    # The queue is full: each newcomer sheds the newest request of the lowest tier below its own...
    add("standard", standard)
    assert errors == {"batch-2": "shed"}
    # ...a batch request cannot displace another batch request...
    add("batch-3", batch)
    assert errors["batch-3"] == "overloaded"
    # ...and critical displaces the remaining batch request, not the standard one.
    add("critical", critical)
    assert errors["batch-1"] == "shed"
    assert core.scheduler.stats.num_waiting == 2
    assert set(core.scheduler.requests) == {"running", "standard", "critical"}


def _held_while_the_batch_runs(core: EngineCore, steps: int) -> EngineCoreOutputs:
    step = core.step()
    for _ in range(steps - 1):
        step = core.step()
    return step


def test_static_batching_admits_the_next_batch_only_when_idle(tiny_llama: Path) -> None:
    core = _core(tiny_llama, StaticBatchingEngineCore, max_num_seqs=4)
    core.add_request(_add("a", 500))
    core.add_request(_add("b", 500))
    core.step()
    core.add_request(_add("late", 3))
    # Held back while the batch makes progress, although there are free sequence slots...
    step = _held_while_the_batch_runs(core, 20)
    assert "late" not in step.started
    assert (step.stats.num_running, step.stats.num_waiting) == (2, 1)
    # ...and admitted once the engine is idle.
    core.abort_requests(["a", "b"])
    assert core.step().started == ["late"]


def test_static_batch_size_is_max_num_seqs(tiny_llama: Path) -> None:
    core = _core(tiny_llama, StaticBatchingEngineCore, max_num_seqs=2)
    for index in range(5):
        core.add_request(_add(f"r{index}", 6))
    batches = []
    while core.has_unfinished_requests():
        step = core.step()
        if step.started:
            batches.append(sorted(step.started))
            # A new batch starts only once every request of the previous one has finished.
            assert step.stats.num_running == len(step.started)
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_small_steps_leave_the_reserved_cpus_to_the_front_end(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps run on the CPUs left after the API servers' share; a long prefill on all of them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads_before = torch.get_num_threads()
    available = len(os.sched_getaffinity(0))
    try:
        core = _core(tiny_llama, reserved_cpus=1)
        core.add_request(_add("long-prompt", 2, prompt=list(range(5, 45))))
        core.step()  # the 40-token prefill
        assert torch.get_num_threads() == available
        core.step()  # one decode
        assert torch.get_num_threads() == max(1, available - 1)
    finally:
        torch.set_num_threads(threads_before)


def test_the_cpu_kv_cache_holds_what_its_sequences_fill_unless_sized(tiny_llama: Path) -> None:
    """Unset, cpu_kv_cache_space gives max_num_seqs sequences of max_model_len tokens, at most a GiB; set,
    the GiB asked for; vLLM's kv_cache_memory_bytes, the bytes asked for, whole blocks of them."""
    config = json.loads((tiny_llama / "config.json").read_text())
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    block_bytes = config["num_hidden_layers"] * 2 * 16 * kv_heads * head_dim * 4  # K and V, float32
    sized = {"num_gpu_blocks_override": None, "block_size": 16, "max_model_len": 500}
    assert _core(tiny_llama, max_num_seqs=3, **sized).num_kv_blocks == 3 * 32  # 500 tokens: 32 blocks
    assert _core(tiny_llama, max_num_seqs=8192, **sized).num_kv_blocks == 2**30 // block_bytes
    asked = _core(tiny_llama, max_num_seqs=3, cpu_kv_cache_space=1 / 16, **sized)
    assert asked.num_kv_blocks == 2**30 // 16 // block_bytes
    # More than the 96 blocks three sequences fill: the bytes asked for decide.
    in_bytes = _core(tiny_llama, max_num_seqs=3, kv_cache_memory_bytes=100 * block_bytes + 1, **sized)
    assert in_bytes.num_kv_blocks == 100
    with pytest.raises(ValueError, match="less than one sequence"):
        _core(tiny_llama, kv_cache_memory_bytes=31 * block_bytes, **sized)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive"):
        _core(tiny_llama, kv_cache_memory_bytes=0, **sized)


def test_an_auto_max_model_len_is_what_the_kv_cache_holds_where_it_holds_less(tiny_llama: Path) -> None:
    """vLLM's auto (-1): the model's context where the KV cache holds it, else the tokens the cache holds."""
    context = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    whole = _core(tiny_llama, max_model_len=-1, block_size=16, num_gpu_blocks_override=context // 16 + 1)
    assert whole.max_model_len == context
    held = _core(tiny_llama, max_model_len=-1, block_size=16, num_gpu_blocks_override=5)
    assert held.max_model_len == held.scheduler.max_model_len == 5 * 16


def test_vllms_active_sequences_and_scheduled_tokens_bound_each_step(tiny_llama: Path) -> None:
    """max_num_active_seqs: no step runs more requests, below max_num_seqs; max_num_scheduled_tokens: no step
    schedules more tokens, below max_num_batched_tokens. The requests all finish."""
    bounds = {"max_num_active_seqs": 2, "max_num_batched_tokens": 64, "max_num_scheduled_tokens": 16}
    core = _core(tiny_llama, max_num_seqs=8, **bounds)
    steps: list[SchedulerOutput] = []
    schedule = core.scheduler.schedule

    def recorded() -> SchedulerOutput:
        steps.append(schedule())
        return steps[-1]

    core.scheduler.schedule = recorded  # type: ignore[method-assign]
    for i in range(4):
        core.add_request(_add(f"r{i}", 3, prompt=list(range(5, 45))))
    tokens, errors = _run_to_end(core)
    assert not errors and all(len(tokens[f"r{i}"]) == 3 for i in range(4))
    assert max(len(step.num_scheduled_tokens) for step in steps) == 2
    assert max(step.total_num_scheduled_tokens for step in steps) == 16
    with pytest.raises(ValueError, match=r"max_num_active_seqs \(9\) cannot be more than max_num_seqs \(8\)"):
        _core(tiny_llama, max_num_seqs=8, max_num_active_seqs=9)
