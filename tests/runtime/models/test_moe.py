"""Mixture-of-experts models: their configs as Transformers reads them, bad ones refused naming the field; the
experts' checkpoint layouts and each rank's share of them (tensor- and expert-parallel, both ranks run here:
the multi-process engine is checked with expert parallelism in test_parallel_parity.py); the grouped matmul;
and the routing counted as Transformers routes."""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.distributed.parallel import ParallelContext, check_model_fits, set_parallel_context
from kvfleet.runtime.models.loader import LoadStats, iterate_weights
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe import FusedMoE, GroupedLinear, MoeForCausalLM, SparseMoeBlock
from kvfleet.runtime.worker.model_runner import ModelRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel, Qwen3MoeSparseMoeBlock

MOE_ARCHS = ("mixtral", "qwen3-moe")
# One expert's tensor in a checkpoint that names them one by one: layer, expert, projection.
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_GATE, _UP = ("w1", "gate_proj"), ("w3", "up_proj")

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_experts": 6,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 7}, r"num_experts_per_tok 7 must be between 1 and num_experts \(6\)"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok 0 must be between 1"),
        ({"num_experts": None, "num_local_experts": 0}, "num_local_experts must be positive"),
        ({"moe_intermediate_size": None}, "missing 'moe_intermediate_size'"),
        ({"mlp_only_layers": [1, 4]}, r"mlp_only_layers names layers \[4\] outside \[0, 4\)"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be positive"),
        (
            {"model_type": "mixtral", "num_experts": None, "num_local_experts": 2, "num_experts_per_tok": 3},
            r"num_experts_per_tok 3 must be between 1 and num_local_experts \(2\)",
        ),
        (
            {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_experts": None},
            "missing 'num_local_experts'",
        ),
    ],
)
def test_bad_moe_configs_are_refused_naming_the_field(change: dict, message: str) -> None:
    raw = {key: value for key, value in {**QWEN3_MOE, **change}.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_mixtral_reads_num_local_experts() -> None:
    raw = {**QWEN3_MOE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    del raw["num_experts"]
    moe = ModelConfig.from_dict({**raw, "num_local_experts": 4, "num_experts_per_tok": 3}).moe
    assert moe is not None
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 3, 128)
    assert moe.norm_topk_prob and moe.sparse_layers == (True,) * 4


@pytest.mark.parametrize(("step", "dense"), [(1, []), (2, []), (1, [0, 3]), (2, [1])])
def test_sparse_layers_are_those_transformers_builds(step: int, dense: list[int]) -> None:
    raw = {**QWEN3_MOE, "decoder_sparse_step": step, "mlp_only_layers": dense}
    moe = ModelConfig.from_dict(raw).moe
    assert moe is not None
    reference = Qwen3MoeModel(Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    assert moe.sparse_layers == tuple(
        isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in reference.layers
    )


def test_splits_that_do_not_fit_the_experts_are_refused() -> None:
    config = ModelConfig.from_dict({**QWEN3_MOE, "moe_intermediate_size": 30})
    check_model_fits(config, 2, 1, enable_expert_parallel=True)
    check_model_fits(config, 2, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 experts"):
        check_model_fits(config, 4, 1, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="does not divide the experts' intermediate size 30"):
        check_model_fits(config, 4, 1)
    # The dense MLP's width matters only where a layer keeps one.
    all_sparse = {**QWEN3_MOE, "intermediate_size": 30, "num_experts": 8}
    check_model_fits(ModelConfig.from_dict(all_sparse), 4, 1, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="the model's intermediate size 30"):
        check_model_fits(ModelConfig.from_dict({**all_sparse, "mlp_only_layers": [0]}), 4, 1)


def _stacked_copy(folder: Path, destination: Path) -> Path:
    """The folder with its experts stacked as Transformers 5 holds them: per layer, gate_up_proj [experts, 2 x
    intermediate, hidden] (gate rows, then up rows) and down_proj [experts, hidden, intermediate]."""
    shutil.copytree(folder, destination)
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    tensors = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            tensors[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        experts.setdefault(int(match[1]), {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for layer, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        gate_up = [torch.cat([_pick(p, _GATE), _pick(p, _UP)]) for p in ordered]
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [_pick(p, ("w2", "down_proj")) for p in ordered]
        )
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def _pick(projections: dict[str, torch.Tensor], names: tuple[str, str]) -> torch.Tensor:
    return next(projections[name] for name in names if name in projections)


def _load_shard(folder: Path, parallel: ParallelContext) -> MoeForCausalLM:
    set_parallel_context(parallel)
    try:
        config = ModelConfig.from_folder(folder)
        model = MoeForCausalLM(config, None, 64)  # type: ignore[arg-type]  # no step runs
        with torch.no_grad():
            model.load_weights(
                iterate_weights([folder / "model.safetensors"], model, LoadStats(), use_tqdm=False)
            )
        return model
    finally:
        set_parallel_context(ParallelContext())


def _expected_shard(folder: Path, layer: int, parallel: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's w13 and w2 of a layer, cut from the per-expert checkpoint tensors."""
    moe = ModelConfig.from_folder(folder).moe
    assert moe is not None
    tensors = load_file(str(folder / "model.safetensors"))
    per_expert: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is not None and int(match[1]) == layer:
            per_expert.setdefault(int(match[2]), {})[match[3]] = tensor
    tp, rank = parallel.tp_size, parallel.tp_rank
    experts = range(moe.num_experts)
    width = moe.moe_intermediate_size
    columns = slice(0, width)
    if parallel.enable_expert_parallel:
        share = moe.num_experts // tp
        experts = range(rank * share, (rank + 1) * share)
    else:
        columns = slice(rank * width // tp, (rank + 1) * width // tp)
    w13 = torch.stack(
        [
            torch.cat([_pick(per_expert[e], _GATE)[columns], _pick(per_expert[e], _UP)[columns]])
            for e in experts
        ]
    )
    w2 = torch.stack([_pick(per_expert[e], ("w2", "down_proj"))[:, columns] for e in experts])
    return w13, w2


def _experts_of(model: MoeForCausalLM) -> FusedMoE:
    block = model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    return block.experts


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_each_rank_reads_its_experts_from_either_layout_and_their_parts_sum_to_the_whole(
    arch: str, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Both ranks of each split, in one process: each holds its cut of the per-expert checkpoint, read from
    either layout, and the two ranks' outputs (which the ranks all-reduce) add up to one rank's."""
    per_expert = tiny_model(arch)
    stacked = _stacked_copy(per_expert, tmp_path / "stacked")
    whole = _experts_of(_load_shard(per_expert, ParallelContext()))
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, whole.w13_weight.shape[2], generator=generator)
    chosen = torch.stack([torch.randperm(whole.num_experts, generator=generator)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=generator)
    sizes = torch.bincount(chosen.flatten(), minlength=whole.num_experts).tolist()
    with torch.inference_mode():
        expected = whole(hidden, weights, chosen, sizes)
        for expert_parallel in (False, True):
            ranks = [
                ParallelContext(tp_size=2, rank=r, enable_expert_parallel=expert_parallel) for r in (0, 1)
            ]
            for folder in (per_expert, stacked):
                summed = torch.zeros_like(hidden)
                for parallel in ranks:
                    experts = _experts_of(_load_shard(folder, parallel))
                    w13, w2 = _expected_shard(per_expert, 0, parallel)
                    assert torch.equal(experts.w13_weight, w13), (parallel, folder.name)
                    assert torch.equal(experts.w2_weight, w2), (parallel, folder.name)
                    summed += experts(hidden, weights, chosen, sizes)
                torch.testing.assert_close(summed, expected, atol=1e-5, rtol=1e-5)


def test_missing_expert_tensors_are_named(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model("qwen3-moe"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing 1 expert tensors, e\.g\. model\.layers\.0\.mlp\.experts\.5\.up_proj"
    ):
        _load_shard(folder, ParallelContext())


def test_lora_is_refused_with_the_reason(tiny_model: Callable[[str], Path]) -> None:
    config = EngineConfig(model=str(tiny_model("mixtral")), enable_lora=True)
    with pytest.raises(ValueError, match="enable_lora is not supported for MixtralForCausalLM"):
        ModelRunner(config)


@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (64, 22), (30, 16)])
def test_grouped_linear_is_a_matmul_per_expert(in_features: int, out_features: int) -> None:
    """The grouped matmul (row strides of multiples of 16 bytes) and the fallback (others); empty groups."""
    generator = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 1]
    x = torch.randn(sum(sizes), in_features, generator=generator)
    weight = torch.randn(len(sizes), out_features, in_features, generator=generator)
    expected = torch.cat(
        [rows.double() @ w.double().T for rows, w in zip(x.split(sizes), weight, strict=True)]
    )
    layer = GroupedLinear()
    for implementation in (layer.forward_cpu, layer.forward_native):
        torch.testing.assert_close(implementation(x, weight, sizes).double(), expected, atol=1e-4, rtol=1e-5)


def _routed_counts(
    model: torch.nn.Module, sequences: Iterator[list[int]], top_k: int, num_experts: int
) -> list[torch.Tensor]:
    """Transformers' routing of each sequence, counted per sparse layer and expert."""
    counts: list[torch.Tensor] = []
    for tokens in sequences:
        with torch.inference_mode():
            router_logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
        for index, logits in enumerate(router_logits):
            chosen = logits.float().softmax(-1).topk(top_k, dim=-1).indices.flatten()
            layer_counts = torch.bincount(chosen, minlength=num_experts)
            if index < len(counts):
                counts[index] += layer_counts
            else:
                counts.append(layer_counts)
    return counts


def test_expert_load_counts_what_transformers_routes(tiny_model: Callable[[str], Path]) -> None:
    """Qwen3-MoE's tiny model: a sparse layer, then a dense one (Mixtral's counts are checked served)."""
    folder = tiny_model("qwen3-moe")
    rng = random.Random(5)
    prompts = [[rng.randrange(8, 1000) for _ in range(n)] for n in (9, 23)]
    llm = LLM(
        str(folder),
        dtype="float32",
        num_gpu_blocks_override=32,
        block_size=8,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    # The tokens each layer ran: every prompt token and every output but the last.
    ran = (
        prompt + list(output.outputs[0].token_ids)[:-1]
        for prompt, output in zip(prompts, outputs, strict=True)
    )
    moe = ModelConfig.from_folder(folder).moe
    assert moe is not None
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = _routed_counts(reference, ran, moe.num_experts_per_tok, moe.num_experts)
    model = llm.llm_engine.engine_core.executor.runner.model
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert [block.expert_tokens.tolist() for block in blocks] == [c.tolist() for c in expected]
    load = llm.llm_engine.engine_core.stats.moe_layer_load
    assert [(entry.routed_tokens, entry.busiest_expert_tokens) for entry in load] == [
        (int(c.sum()), int(c.max())) for c in expected
    ]
