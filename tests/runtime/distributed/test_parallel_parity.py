"""Tensor- and pipeline-parallel engines (worker processes over gloo) give the one-process engine's tokens.

For every dense architecture at TP=4 and TP=2 x PP=2, the llama also at TP=2 and at PP=2, and Mixtral at
TP=2 with expert parallelism: greedy outputs of a mixed batch (prompts of many lengths, shared prefixes, a
token budget that chunks prefills beside decodes, and a KV cache too small for all of them, so that requests
are preempted and recomputed) equal the TP=1 engine's. What differs between architectures is how their
weights are split: TP=2 x PP=2 splits them both ways at once, and TP=4 over more ranks than the models have
KV heads, so that ranks share a head. TP=2 and PP=2 alone take no path of their own per architecture.

Each rank reports what loading held, measured on its own parameters and on the slices it read: at most 1/tp
of the weights (plus what every rank keeps whole) and a load buffer no larger than a slice of the largest
tensor. Quantized folders (int8, int4 and float8, the LM head too) split at TP=2, TP=2 x PP=2 or PP=2 give
their one-rank engine's tokens. A rank that cannot load its shard makes the engine's start fail with the
rank's reason.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.executor.executor import MultiprocExecutor, WorkerFailedError
from kvfleet.runtime.models.make_model.quantize import quantize_folder
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe_config import MoeLayerLoad
from processes import child_processes
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

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


@pytest.mark.parametrize("quantize", [(), ("--quantize", "w8a16")], ids=["float", "w8a16"])
def test_mixtral_with_expert_parallelism_equals_one_rank(
    make_model: Callable[..., Path], quantize: tuple[str, ...]
) -> None:
    """Each rank holds half the experts, in float or int8; the core hears the ranks' expert load. (Tensor
    parallelism without expert parallelism splits the experts as the dense MLP is split: its ranks' parts are
    checked in one process, in test_moe.py and, quantized, test_quantized_checkpoints.py.)"""
    model = make_model("mixtral", "tiny", 0, *quantize)
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


QUANTIZED = [("w8a16", "lm-head-odd-vocabulary", 2, 1), ("w8a16", "lm-head-odd-vocabulary", 2, 2)]
QUANTIZED += [("fp8", "", 2, 1), ("fp8", "per-tensor-scales", 2, 1), ("w4a16", "", 1, 2)]
QUANTIZED += [("w4a16", "wide", 2, 1), ("w4a16", "wide", 2, 2)]


@pytest.fixture(scope="module")
def quantized_reference(
    request: pytest.FixtureRequest, make_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list, list]:
    """The tiny llama quantized, and its outputs on one rank. Variants: its LM head quantized too, with a
    vocabulary one id short of what the ranks divide (the last rank's slice is padded); float8 weights with
    one scale each instead of one per output channel; layers wide enough that each of two ranks holds whole
    groups of int4's scales."""
    scheme, variant = request.param
    model = tmp_path_factory.mktemp("quantized") / f"llama-{scheme}{variant}"
    if variant == "wide":
        _widened(make_model("llama", "tiny"), model)
    else:
        shutil.copytree(make_model("llama", "tiny"), model)
    config_path, weights_path = model / "config.json", model / "model.safetensors"
    if variant == "lm-head-odd-vocabulary":
        config = json.loads(config_path.read_text())
        config["vocab_size"] -= 1
        config_path.write_text(json.dumps(config))
        tensors = load_file(weights_path)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = tensors[name][: config["vocab_size"]].contiguous()
        save_file(tensors, weights_path, metadata={"format": "pt"})
    quantize_folder(model, scheme, lm_head=variant == "lm-head-odd-vocabulary")
    if variant == "per-tensor-scales":
        _fp8_scale_per_tensor(config_path, weights_path)
    prompts = _prompts(len(scheme))
    return model, prompts, _one_rank(model, prompts)[0]


def _widened(tiny: Path, out: Path) -> None:
    """A llama of the tiny one's vocabulary and tokenizer whose projections read 256 or 512 columns (int4's
    groups are of 128), with Transformers' random weights."""
    config = json.loads((tiny / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_dict(config)).save_pretrained(out)
    for path in tiny.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)


def _fp8_scale_per_tensor(config_path: Path, weights_path: Path) -> None:
    """A float8 folder's weights quantized again with one scale each (the largest value over float8's)."""
    tensors = load_file(weights_path)
    for name in [name for name in tensors if name.endswith(".weight_scale")]:
        prefix = name.removesuffix(".weight_scale")
        weight = tensors[f"{prefix}.weight"].float() * tensors[name].float()
        scale = weight.abs().max() / torch.finfo(torch.float8_e4m3fn).max
        tensors[f"{prefix}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[name] = scale.reshape(1).to(tensors[name].dtype)
    save_file(tensors, weights_path, metadata={"format": "pt"})
    config = json.loads(config_path.read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["strategy"] = "tensor"
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("quantized_reference", "tp", "pp"),
    [((scheme, variant), tp, pp) for scheme, variant, tp, pp in QUANTIZED],
    ids=[
        f"{scheme}{'-' + variant if variant else ''}-tp{tp}-pp{pp}" for scheme, variant, tp, pp in QUANTIZED
    ],
    indirect=["quantized_reference"],
)
def test_quantized_folders_split_between_ranks_give_one_ranks_tokens(
    quantized_reference: tuple[Path, list, list], tp: int, pp: int
) -> None:
    """Each rank holds its share of the packed int words or float8 weights and their scales (one per output
    channel: a row-parallel projection's whole on every rank; one per group of input columns: shared out with
    those columns); a padded LM head slice's rows past the vocabulary are zeros, not scales left unloaded."""
    model, prompts, expected = quantized_reference
    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_OPTIONS)
    try:
        assert _generate(llm, prompts) == expected
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_rank_that_cannot_load_says_why_and_every_rank_is_stopped(make_model: Callable[..., Path]) -> None:
    """The engine's error carries the rank's reason (its exit status would say nothing of it), and no worker
    outlives the failed start: the tiny model with int4 weights at TP=2, where the MLP's 11 groups of input
    columns cannot be shared out whole."""
    model = make_model("llama", "tiny", 0, "--quantize", "w4a16")
    before = set(child_processes(os.getpid()))
    reason = (
        r"rank \d could not load the model: ValueError: .*down_proj.weight_scale: tensor_parallel_size 2 "
    )
    reason += "does not divide its 11 groups of input columns"
    with pytest.raises(WorkerFailedError, match=reason):
        LLM(str(model), **{**ENGINE_OPTIONS, "tensor_parallel_size": 2})
    assert set(child_processes(os.getpid())) == before
