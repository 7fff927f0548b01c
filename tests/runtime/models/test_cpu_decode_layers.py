"""The decoder layers in one C++ call (`models.cpu_decode_layers`) against the model's own layer-by-layer
forward, which the model tests hold to Transformers: the same operations in the same order, so tokens and
logprobs must agree bit for bit. Each case takes a path of the layer: float32 projections through oneDNN
(packed, or plain where oneDNN cannot pack them), int8 ones with channel and group scales, Q/K/V biases,
Qwen3's per-head norms, a sliding window shorter than the contexts, and mixture-of-experts layers (float32
experts stacked, int8 ones one by one, beside a dense layer in Qwen3-MoE's), whose expert load must be
counted alike."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.attention.sdpa import SdpaPlan
from kvfleet.runtime.models.cpu_decode_layers import CpuDecodeLayers
from kvfleet.runtime.models.layers import ONEDNN_ENV_VAR
from kvfleet.runtime.models.moe import SparseMoeBlock
from kvfleet.runtime.quantization.linear import FUSED_MAX_ROWS

# (architecture, make-model options, environment).
CASES = {
    "llama float32": ("llama", (), {}),
    "llama float32, weights not packed for oneDNN": ("llama", (), {ONEDNN_ENV_VAR: "0"}),
    "qwen3 float32, head norms": ("qwen3", (), {}),
    "llama w8a16": ("llama", ("--quantize", "w8a16", "--quantize-lm-head"), {}),
    "qwen2 w4a16, biases": ("qwen2", ("--quantize", "w4a16"), {}),
    "qwen3 w8a16, head norms": ("qwen3", ("--quantize", "w8a16"), {}),
    "mistral w8a16, window of 16": ("mistral", ("--quantize", "w8a16", "--sliding-window", "16"), {}),
    "mixtral float32 experts": ("mixtral", (), {}),
    "qwen3-moe w8a16 experts, a dense layer": ("qwen3-moe", ("--quantize", "w8a16"), {}),
    "mixtral w4a16 experts": ("mixtral", ("--quantize", "w4a16"), {}),
}
MAX_TOKENS = 24


@pytest.mark.parametrize("case", list(CASES))
def test_decoder_layers_in_one_call_match_the_layer_by_layer_forward(
    case: str, make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, options, environment = CASES[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    llm = LLM(
        str(make_model(arch, "tiny", 0, *options)),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    model = llm.llm_engine.runner.model
    assert model.cpu_decode_layers is not None
    if ONEDNN_ENV_VAR in environment:
        assert model.layers[0].self_attn.qkv_proj.packed_weight is None
    model.cpu_decode_layers = counted = _CountedSteps(model.cpu_decode_layers)
    rng = random.Random(3)
    # Decodes of one to three requests a step, contexts from 2 to 64 tokens (past the window).
    prompts = [[rng.randrange(16, 200) for _ in range(n)] for n in (2, 9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)

    def run() -> list[tuple[list[int], list[dict[int, float]]]]:
        outputs = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
        return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]

    def routed() -> list[list[int]]:  # each sparse layer's count of the pairs routed to each expert
        return [
            block.expert_tokens.tolist() for block in model.modules() if isinstance(block, SparseMoeBlock)
        ]

    in_one_call = run()
    routed_in_one_call = routed()
    assert bool(routed_in_one_call) == (arch in ("mixtral", "qwen3-moe"))
    # Every decode step of both runs: all but each run's first token, which its prefill samples.
    assert counted.steps == 2 * (MAX_TOKENS - 1)
    model.cpu_decode_layers = None
    assert run() == in_one_call
    assert routed() == [[2 * n for n in layer] for layer in routed_in_one_call]


def test_steps_of_more_tokens_than_the_int8_kernel_takes_keep_the_layer_by_layer_forward(
    make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past FUSED_MAX_ROWS the model's int8 projections dequantize; two rows here, so that three decodes pass.
    for width in list(FUSED_MAX_ROWS):
        monkeypatch.setitem(FUSED_MAX_ROWS, width, 2)
    llm = LLM(
        str(make_model("llama", "tiny", 0, "--quantize", "w8a16")),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    model = llm.llm_engine.runner.model
    assert model.cpu_decode_layers is not None
    model.cpu_decode_layers = counted = _CountedSteps(model.cpu_decode_layers)
    prompts = [[17, 30, 41], [99, 5], [60, 61, 62, 63]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (4, 8, 12)]

    def run() -> list[tuple[list[int], list[dict[int, float]]]]:
        return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in llm.generate(prompts, params)]

    in_one_call = run()
    assert 3 in counted.refused_tokens and counted.steps == 8  # the steps of two decodes, then of one
    model.cpu_decode_layers = None
    assert run() == in_one_call


class _CountedSteps:
    """Counts the steps the decoder layers take, and the tokens of the decode steps they do not."""

    def __init__(self, layers: CpuDecodeLayers) -> None:
        self.layers, self.steps = layers, 0
        self.refused_tokens: list[int] = []

    def takes(self, plan: SdpaPlan) -> bool:
        taken = self.layers.takes(plan)
        if not taken and plan.kernel_decodes is not None and not plan.prefill_chunks:
            self.refused_tokens.append(plan.slot_mapping.numel())
        return taken

    def __call__(self, *args: Any) -> Any:
        self.steps += 1
        return self.layers(*args)


@pytest.mark.parametrize(
    "options",
    [dict(dtype="bfloat16"), dict(dtype="float32", enable_lora=True, max_lora_rank=8)],
    ids=["bfloat16", "LoRA"],
)
def test_layers_the_call_cannot_run_keep_the_layer_by_layer_forward(tiny_llama: Path, options: dict) -> None:
    # The layer operations take float32 only, and LoRA's wrapped projections add their adapters' terms.
    llm = LLM(str(tiny_llama), num_gpu_blocks_override=16, max_model_len=64, **options)
    assert llm.llm_engine.runner.model.cpu_decode_layers is None
