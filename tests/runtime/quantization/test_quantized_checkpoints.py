"""Quantized checkpoints as `make-model --quantize` writes them (with compressed-tensors' own code):
kvfleet's greedy tokens against Transformers' on the same folder, which compressed-tensors dequantizes for
it, dense and mixture-of-experts models; each tensor-parallel rank's share of quantized experts; and folders
kvfleet refuses, with the field that says why.

The fused int8 matmul sums each row in another order than a float matmul over the dequantized weight, so the
criterion is vLLM's: tokens equal, or at the first difference each side's token in the other's top-5; and,
while the tokens agree, each chosen token's logprob within LOGPROB_TOLERANCE of Transformers'.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.distributed.parallel import ParallelContext, set_parallel_context
from kvfleet.runtime.kernels.fused_layers import Implementation
from kvfleet.runtime.models.loader import load_model
from kvfleet.runtime.models.make_model import make_model as write_model
from kvfleet.runtime.models.make_model.quantize import quantize_folder
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe import FusedMoE, Int8Experts, RoutedExperts, SparseMoeBlock
from kvfleet.runtime.quantization.config import kv_cache_dtype_refusal, weight_quantization
from kvfleet.runtime.quantization.linear import Int8Linear
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

MAX_TOKENS = 8
TOP_N = 5
# float32 sums of a few hundred terms in another order differ by about 1e-6 relative; logprobs of these
# tiny models are a few units, so 1e-3 leaves room without hiding a wrong scale (which moves them by tenths).
LOGPROB_TOLERANCE = 1e-3
# (scheme, architecture, whether the LM head is quantized too), by name. Each scheme on another architecture:
# Qwen2's q/k/v biases go through the int8 projections, Qwen3's head_dim differs from hidden_size / heads.
# The mixture-of-experts models' experts are quantized one by one (llm-compressor's layout).
CASES = {
    "w8a16": ("w8a16", "llama", False),
    "w4a16": ("w4a16", "qwen2", False),
    "fp8": ("fp8", "qwen3", False),
    "w8a16, LM head too": ("w8a16", "llama", True),
    "w8a16 experts": ("w8a16", "qwen3-moe", False),
    "w4a16 experts": ("w4a16", "mixtral", False),
    "fp8 experts": ("fp8", "mixtral", False),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    """Prompts of 3 to 300 tokens: prefills both shorter and longer than the fused kernel's row limit."""
    rng = random.Random(7)
    return [[rng.randrange(16, vocab_size) for _ in range(n)] for n in (3, 11, 300)]


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Transformers' greedy tokens and top-5 logprobs at each step, one prompt at a time."""
    quantized = "quantization_config" in json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True) if quantized else None,
    ).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            steps = []
            for logits in out.logits:
                top = torch.log_softmax(logits[0].float(), dim=-1).topk(TOP_N)
                steps.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
            results.append((out.sequences[0, len(prompt) :].tolist(), steps))
    return results


def _quantized_copy(float_dir: Path, scheme: str, parent: Path, lm_head: bool = False) -> Path:
    """What `make-model --quantize` (and `--quantize-lm-head`) writes, from the float folder the other model
    tests share."""
    model_dir = parent / f"{float_dir.name}-{scheme}{'-lm-head' if lm_head else ''}"
    shutil.copytree(float_dir, model_dir)
    quantize_folder(model_dir, scheme, lm_head=lm_head)
    return model_dir


def _decompressed_copy(model_dir: Path, parent: Path) -> Path:
    """The folder with each quantized projection decompressed to float32 by compressed-tensors, and no
    quantization_config: the reference for float8 experts, which Transformers dequantizes to bfloat16 (its
    `DecompressExperts`), where its dense float8 projections stay in float32."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    copy = parent / f"{model_dir.name}-decompressed"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    quantization = QuantizationConfig.model_validate(config.pop("quantization_config"))
    (copy / "config.json").write_text(json.dumps(config))
    (scheme,) = quantization.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(quantization.format)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        module, _, part = name.rpartition(".")
        by_module.setdefault(module, {})[part] = tensor
    tensors = {}
    for module, parts in by_module.items():
        if "weight_scale" in parts:
            parts = {"weight": compressor.decompress(parts, scheme)["weight"]}
        tensors |= {f"{module}.{part}": tensor for part, tensor in parts.items()}
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def _int8_projections(model_dir: Path, scheme: str) -> int:
    """How many projections kvfleet holds in int8: one for each that the checkpoint quantizes, but one for
    q/k/v together and one for gate/up together, of an MLP or an expert. Float8 weights are dequantized on
    load."""
    names = load_file(model_dir / "model.safetensors")
    quantized = [name.removesuffix(".weight_scale") for name in names if name.endswith(".weight_scale")]
    fused = [name for name in quantized if name.endswith(("k_proj", "v_proj", "up_proj", "w3"))]
    return 0 if scheme == "fp8" else len(quantized) - len(fused)


@pytest.fixture(scope="module", params=list(CASES))
def quantized_case(
    request: pytest.FixtureRequest, make_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
):
    scheme, arch, lm_head = CASES[request.param]
    parent = tmp_path_factory.mktemp("quantized")
    model_dir = _quantized_copy(make_model(arch, "tiny"), scheme, parent, lm_head)
    prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    float8_experts = scheme == "fp8" and arch in ("mixtral", "qwen3-moe")
    reference_dir = _decompressed_copy(model_dir, parent) if float8_experts else model_dir
    return scheme, lm_head, model_dir, prompts, _reference(reference_dir, prompts)


def test_greedy_matches_transformers_on_the_quantized_folder(quantized_case) -> None:
    scheme, lm_head, model_dir, prompts, reference = quantized_case
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=512)
    model = llm.llm_engine.runner.model
    int8_layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # Int weights stay int8, in the fused kernel on this host.
    assert len(int8_layers) == _int8_projections(model_dir, scheme)
    assert isinstance(model.lm_head, Int8Linear) == lm_head
    assert all(layer.kernel is Implementation.CPU for layer in int8_layers)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    # The batch decodes several rows a step, the last prompt alone one row: both paths of the kernel.
    outputs = llm.generate(prompts, params) + llm.generate(prompts[-1:], params)
    for i, (output, (ref_tokens, ref_steps)) in enumerate(
        zip(outputs, [*reference, reference[-1]], strict=True)
    ):
        completion = output.outputs[0]
        for step, (ours, theirs) in enumerate(zip(completion.token_ids, ref_tokens, strict=True)):
            our_top = completion.logprobs[step]
            if ours != theirs:
                assert ours in ref_steps[step] and theirs in our_top, (
                    f"{scheme} prompt {i} step {step}: kvfleet {ours} vs transformers {theirs}"
                )
                break
            assert abs(our_top[ours] - ref_steps[step][theirs]) <= LOGPROB_TOLERANCE, (
                f"{scheme} prompt {i} step {step}: logprob {our_top[ours]} vs {ref_steps[step][theirs]}"
            )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq"}, "GPTQ checkpoints"),
        (
            {"config_groups": {"g": {"weights": {"type": "nf", "num_bits": 4}}}},
            "config_groups.g.weights.type",
        ),
        (
            {
                "config_groups": {
                    "g": {
                        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
                        "input_activations": {"type": "int", "num_bits": 8},
                    }
                }
            },
            "config_groups.g.input_activations",
        ),
        (
            {"config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}},
            "config_groups.g.weights.group_size",
        ),
        ({"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        (
            {
                "config_groups": {
                    "g": {
                        "weights": {
                            "type": "int",
                            "num_bits": 4,
                            "strategy": "group",
                            "group_size": 128,
                            "actorder": "group",
                        }
                    }
                }
            },
            "config_groups.g.weights.actorder: activation ordering by group",
        ),
    ],
)
def test_unsupported_quantization_configs_are_refused_by_field(change: dict, field: str) -> None:
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}},
        **change,
    }
    with pytest.raises(ValueError, match=field):
        weight_quantization(config, None)


def test_quantization_method_is_checked_against_the_folder() -> None:
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}},
    }
    assert weight_quantization(config, "compressed-tensors") == weight_quantization(config, None)
    with pytest.raises(ValueError, match=r"'awq' was asked for, but .*quant_method is 'compressed-tensors'"):
        weight_quantization(config, "awq")
    with pytest.raises(ValueError, match=r"'int3' is not a method vLLM names"):
        weight_quantization(config, "int3")
    with pytest.raises(ValueError, match=r"'fp8' was asked for, but config\.json has no quantization_config"):
        weight_quantization(None, "fp8")


def test_scales_of_the_wrong_shape_are_refused_naming_the_tensor(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    folder = _quantized_copy(make_model("llama", "tiny"), "w8a16", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"'{name}' has shape"):
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=16, max_model_len=64)


def test_kv_cache_dtypes_are_refused_with_the_reason() -> None:
    assert kv_cache_dtype_refusal("auto") is None
    assert "a quantized KV cache is not supported" in (kv_cache_dtype_refusal("fp8_e5m2") or "")
    assert "not one of vLLM's KV cache dtypes" in (kv_cache_dtype_refusal("fp9") or "")


@pytest.mark.parametrize(("arch", "scheme"), [("llama", "w2a16"), ("llava", "w8a16")])
def test_make_model_refuses_what_it_cannot_quantize(arch: str, scheme: str, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=f"quantize takes w8a16, w4a16, fp8 on text models, not '{scheme}' on {arch}"
    ):
        write_model(arch, "tiny", tmp_path, quantize=scheme)


def test_make_model_quantizes_the_lm_head_only_with_the_projections(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantize_lm_head quantizes the LM head with the projections"):
        write_model("llama", "tiny", tmp_path, quantize_lm_head=True)


def test_a_tied_lm_head_is_not_quantized_on_its_own(make_model: Callable[..., Path], tmp_path: Path) -> None:
    # A checkpoint whose LM head is its embedding stores no lm_head.weight: nothing to quantize apart.
    folder = Path(shutil.copytree(make_model("llama", "tiny"), tmp_path / "tied"))
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="has no LM head of its own to quantize"):
        quantize_folder(folder, "w8a16", lm_head=True)


def _experts_of_layer_0(folder: Path, parallel: ParallelContext) -> RoutedExperts:
    """The first layer's experts as a rank of `parallel` loads them from a quantized folder."""
    set_parallel_context(parallel)
    try:
        config = ModelConfig.from_folder(folder)
        model = load_model(
            folder,
            config,
            None,
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_position=64,
            use_tqdm=False,
        )
    finally:
        set_parallel_context(ParallelContext())
    block = model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    return block.experts


def _weight_bytes(experts: RoutedExperts) -> int:
    return sum(
        p.numel() * p.element_size() for name, p in experts.named_parameters() if name.endswith("weight")
    )


# (arch, scheme, expert parallelism): int8 experts cut by rows and packed words with per-channel scales, int4
# ones shared out whole with their group scales, float8 ones cut by columns with their per-channel scales.
SPLITS = [("qwen3-moe", "w8a16", False), ("qwen3-moe", "w8a16", True), ("mixtral", "w4a16", True)]
SPLITS += [("mixtral", "fp8", False)]


@pytest.mark.parametrize(("arch", "scheme", "expert_parallel"), SPLITS)
def test_each_rank_holds_its_share_of_quantized_experts_and_their_parts_sum_to_the_whole(
    arch: str, scheme: str, expert_parallel: bool, make_model: Callable[..., Path]
) -> None:
    """Both tensor-parallel ranks, in one process: between them they hold each expert's weight bytes once,
    and their outputs (which the ranks all-reduce) add up to one rank's."""
    folder = make_model(arch, "tiny", 0, "--quantize", scheme)
    whole = _experts_of_layer_0(folder, ParallelContext())
    assert isinstance(whole, FusedMoE if scheme == "fp8" else Int8Experts)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(
        7, json.loads((folder / "config.json").read_text())["hidden_size"], generator=generator
    )
    chosen = torch.stack([torch.randperm(whole.num_experts, generator=generator)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=generator)
    sizes = torch.bincount(chosen.flatten(), minlength=whole.num_experts).tolist()
    ranks = [ParallelContext(tp_size=2, rank=r, enable_expert_parallel=expert_parallel) for r in (0, 1)]
    with torch.inference_mode():
        expected = whole(hidden, weights, chosen, sizes)
        shares = [_experts_of_layer_0(folder, parallel) for parallel in ranks]
        summed = sum(share(hidden, weights, chosen, sizes) for share in shares)
    assert sum(_weight_bytes(share) for share in shares) == _weight_bytes(whole)
    torch.testing.assert_close(summed, expected, atol=1e-5, rtol=1e-5)


def test_a_split_through_a_group_of_quantized_columns_is_refused(make_model: Callable[..., Path]) -> None:
    # The tiny Mixtral's experts are 176 wide: 11 groups of 16 in their down projections' input columns.
    folder = make_model("mixtral", "tiny", 0, "--quantize", "w4a16")
    with pytest.raises(
        ValueError, match="tensor_parallel_size 2 does not divide its 11 groups of input columns"
    ):
        _experts_of_layer_0(folder, ParallelContext(tp_size=2, rank=1))


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        ("w8a16", "is packed: config.json has no quantization_config"),
        ("fp8", "has no place in float experts"),
    ],
)
def test_quantized_experts_without_a_quantization_config_are_refused(
    scheme: str, message: str, make_model: Callable[..., Path], tmp_path: Path
) -> None:
    folder = Path(
        shutil.copytree(make_model("qwen3-moe", "tiny", 0, "--quantize", scheme), tmp_path / "bare")
    )
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=rf"'model\.layers\.0\.mlp\.experts\.\d+\.\w+_proj\.weight_\w+' {message}"
    ):
        _experts_of_layer_0(folder, ParallelContext())


def test_weight_activation_ordering_is_loaded_as_no_ordering() -> None:
    # GPTQ's "weight" ordering (or its alias "static") only changed the order columns were calibrated in.
    weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    plain = weight_quantization({**config, "config_groups": {"g": {"weights": weights}}}, None)
    for actorder in ("weight", "static", None):
        ordered = {"g": {"weights": {**weights, "actorder": actorder}}}
        assert weight_quantization({**config, "config_groups": ordered}, None) == plain
