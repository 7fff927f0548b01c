"""Tensor- and pipeline-parallel engines (worker processes over gloo) give the one-process engine's tokens.

For every dense architecture at TP=4 and TP=2 x PP=2, the llama also at TP=2 and at PP=2, and Mixtral at
TP=2 with expert parallelism: greedy outputs of a mixed batch (prompts of many lengths, shared prefixes, a
token budget that chunks prefills beside decodes, and a KV cache too small for all of them, so that requests
are preempted and recomputed) equal the TP=1 engine's. What differs between architectures is how their
weights are split: TP=2 x PP=2 splits them both ways at once, and TP=4 over more ranks than the models have
KV heads, so that ranks share a head. TP=2 and PP=2 alone take no path of their own per architecture.

Each rank reports what loading held, measured on its own parameters and on the slices it read: at most 1/tp
of the weights (plus what every rank keeps whole) and a load buffer no larger than a slice of the largest
tensor. A rank that cannot load its shard makes the engine's start fail with the rank's reason.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.executor.executor import MultiprocExecutor, WorkerFailedError
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe_config import MoeLayerLoad
from safetensors import safe_open

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
SPLITS = [(2, 1), (4, 1), (1, 2), (2, 2)]
CASES = [
    (arch, tp, pp) for arch in ARCHS for tp, pp in SPLITS if arch == "llama" or (tp, pp) in {(4, 1), (2, 2)}
]
NUM_KV_BLOCKS = 12
ENGINE_OPTIONS = {
    "dtype": "float32",
    "num_gpu_blocks_override": NUM_KV_BLOCKS,
    "block_size": 8,
    "max_model_len": 96,
    "max_num_batched_tokens": 32,
    "enable_prefix_caching": True,
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Prompts of many lengths, half of them sharing a two-block prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(16, 500) for _ in range(16)]
    prompts = []
    for i in range(8):
        own = [rng.randrange(16, 500) for _ in range(rng.choice([2, 9, 20, 30]))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> tuple[Path, list, list]:
    model = make_model(request.param, "tiny")
    prompts = _prompts(len(request.param))
    return model, prompts, _one_rank(model, prompts)[0]


def _one_rank(model: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[MoeLayerLoad]]:
    """The one-process engine's outputs, and its expert load."""
    llm = LLM(str(model), **ENGINE_OPTIONS)
    outputs = _generate(llm, prompts)
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preempted_total > 0, "the batch must preempt"
    assert core.scheduler.stats.prefix_cache_hits > 0, "the batch must hit the prefix cache"
    return outputs, core.executor.expert_load()


def _checkpoint_bytes(model: Path) -> tuple[int, int, int]:
    """(all tensors, those every rank keeps whole: the norms and the routers, the largest tensor), read from
    the file."""
    total = whole = largest = 0
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            size = tensor.numel() * tensor.element_size()
            total += size
            largest = max(largest, size)
            if "norm" in name or name.endswith(".gate.weight"):
                whole += size
    return total, whole, largest


@pytest.mark.parametrize(
    ("reference", "tp", "pp"),
    CASES,
    ids=[f"{arch}-tp{tp}-pp{pp}" for arch, tp, pp in CASES],
    indirect=["reference"],
)
def test_greedy_tokens_equal_one_rank(reference: tuple[Path, list, list], tp: int, pp: int) -> None:
    model, prompts, expected = reference
    _check_parallel_run(model, prompts, expected, tp, pp)


@pytest.mark.parametrize("reference", ["llama"], indirect=True)
def test_two_engines_on_one_host_keep_their_ranks_apart(reference: tuple[Path, list, list]) -> None:
    """Two tensor-parallel engines given the same master port run side by side: ranks on one node meet
    through their executor's own file, so neither engine's ranks join the other's group."""
    model, prompts, expected = reference
    options = {**ENGINE_OPTIONS, "tensor_parallel_size": 2, "master_port": 29501}
    first = LLM(str(model), **options)
    try:
        second = LLM(str(model), **options)
        try:
            assert _generate(second, prompts) == expected
            assert _generate(first, prompts) == expected
        finally:
            second.llm_engine.engine_core.shutdown()
    finally:
        first.llm_engine.engine_core.shutdown()


def test_mixtral_with_expert_parallelism_equals_one_rank(make_model: Callable[..., Path]) -> None:
    """Each rank holds half the experts; the core hears the ranks' expert load. (Tensor parallelism without
    expert parallelism splits the experts as the dense MLP is split: its ranks' parts are checked in one
    process, in test_moe.py.)"""
    model = make_model("mixtral", "tiny")
    prompts = _prompts(7)
    expected, expected_load = _one_rank(model, prompts)
    assert expected_load and all(load.routed_tokens > 0 for load in expected_load)
    load = _check_parallel_run(model, prompts, expected, 2, 1, enable_expert_parallel=True)
    assert load == expected_load


def _check_parallel_run(
    model: Path, prompts: list[list[int]], expected: list[list[int]], tp: int, pp: int, **options: object
) -> list[MoeLayerLoad]:
    """Run the prompts tp x pp ways and check the outputs and what each rank loaded; returns the expert
    load the core heard of."""
    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_OPTIONS, **options)
    core = llm.llm_engine.engine_core
    executor = core.executor
    assert isinstance(executor, MultiprocExecutor)
    workers = list(executor.workers)
    assert len(workers) == tp * pp
    try:
        outputs = _generate(llm, prompts)
        assert outputs == expected
        assert core.scheduler.num_preempted_total > 0
        assert core.scheduler.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS

        total, whole, largest = _checkpoint_bytes(model)
        config = ModelConfig.from_folder(model)
        # With fewer KV heads than ranks, each rank keeps one whole KV head of k_proj and v_proj.
        kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        kv_bytes *= config.hidden_size * 4
        replicated_kv = kv_bytes * max(0.0, 1 / config.num_key_value_heads - 1 / tp)
        for ready in executor.ready:
            share = total / tp + whole + replicated_kv
            assert ready.parameter_bytes <= share, (ready.rank, ready.parameter_bytes, share)
            assert ready.peak_load_buffer_bytes <= largest / tp, (ready.rank, ready.peak_load_buffer_bytes)
        expert_load = executor.expert_load()
    finally:
        core.shutdown()
    for worker in workers:
        assert worker.poll() is not None, f"worker {worker.pid} is still running"
        with pytest.raises(ProcessLookupError):
            os.kill(worker.pid, 0)
    return expert_load


def test_a_rank_that_cannot_load_says_why_and_every_rank_is_stopped(make_model: Callable[..., Path]) -> None:
    """The engine's error carries the rank's reason (its exit status would say nothing of it), and no worker
    outlives the failed start: a quantized folder, which runs on one rank only, at TP=2."""
    model = make_model("llama", "tiny", 0, "--quantize", "w8a16")
    before = _children()
    with pytest.raises(WorkerFailedError, match=r"rank \d could not load the model: ValueError: quantized"):
        LLM(str(model), **{**ENGINE_OPTIONS, "tensor_parallel_size": 2})
    assert _children() == before


def _children() -> set[int]:
    """The pids of this process's children."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid():
            children.add(int(stat.parent.name))
    return children
