"""Multi-LoRA against Hugging Face PEFT: the same adapter on the same base model gives the same greedy tokens,
alone and mixed in one batch with other adapters and base requests, on each architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, LoRARequest, SamplingParams
from kvfleet.runtime.lora.make_adapter import make_adapter
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42, 7]]
LONG_PROMPT = list(range(30, 70))
MAX_TOKENS = 10
# (name, rank, options): ranks differ, and so do targets and scaling.
ADAPTERS = [
    ("all-r8", 8, {}),
    (
        "attention-r4-rslora",
        4,
        {"target_modules": ("q_proj", "v_proj", "o_proj"), "alpha": 8.0, "use_rslora": True},
    ),
    ("mlp-r16", 16, {"target_modules": ("gate_proj", "up_proj", "down_proj"), "alpha": 32.0}),
]


def _peft_tokens(base: Path, adapter: Path | None, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            output = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            tokens.append(output[0, len(prompt) :].tolist())
    return tokens


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_adapters_alone_and_mixed_match_peft(
    arch: str, make_model: Callable[..., Path], tmp_path: Path
) -> None:
    base = make_model(arch, "tiny")
    adapters = {
        name: make_adapter(base, tmp_path / name, rank=rank, seed=index, **options)
        for index, (name, rank, options) in enumerate(ADAPTERS)
    }
    expected = {name: _peft_tokens(base, path) for name, path in adapters.items()}
    expected[None] = _peft_tokens(base, None)
    assert all(expected[name] != expected[None] for name in adapters), "an adapter changed nothing"

    llm = LLM(
        str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        num_gpu_blocks_override=256,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = {
        name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(adapters.items())
    }
    for name, lora in requests.items():
        outputs = llm.generate(PROMPTS, params, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outputs] == expected[name], name

    # One batch: every prompt with every adapter and with none.
    names = [None, *requests]
    batch = [(prompt_index, name) for name in names for prompt_index in range(len(PROMPTS))]
    outputs = llm.generate(
        [PROMPTS[i] for i, _ in batch],
        params,
        lora_request=[requests[name] if name else None for _, name in batch],
    )
    for (prompt_index, name), output in zip(batch, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[name][prompt_index], (name, prompt_index)


def test_more_adapters_than_slots_take_turns(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """With one slot, requests of three adapters wait for theirs; each still gets its own tokens, and the
    prefix cache never hands one adapter's KV to another (the same prompt of several full blocks for all)."""
    base = make_model("llama", "tiny")
    paths = [make_adapter(base, tmp_path / f"a{i}", rank=4, seed=i) for i in range(3)]
    expected = [_peft_tokens(base, path, [LONG_PROMPT])[0] for path in paths]
    llm = LLM(
        str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=4,
        num_gpu_blocks_override=256,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
    outputs = llm.generate([LONG_PROMPT] * 6, params, lora_request=loras + loras)
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected


def test_bad_adapters_are_refused_alone(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """Each bad adapter fails its own request with a message; the next good request runs."""
    base = make_model("llama", "tiny")
    other = make_model("qwen3", "tiny")
    good = make_adapter(base, tmp_path / "good", rank=4)
    too_big = make_adapter(base, tmp_path / "too-big", rank=32)
    wrong_base = make_adapter(other, tmp_path / "wrong-base", rank=4)
    corrupt = make_adapter(base, tmp_path / "corrupt", rank=4)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    dora = make_adapter(base, tmp_path / "dora", rank=4)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))

    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cases = {
        too_big: "above --max-lora-rank 16",
        corrupt: "cannot be read",
        dora: "DoRA",
        tmp_path / "missing": "cannot read",
    }
    # Qwen3's tiny preset has wider attention heads than Llama's: its q_proj adapter cannot fit.
    cases[wrong_base] = "another base model"
    for index, (path, message) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("bad", 10 + index, str(path)))
    outputs = llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("good", 1, str(good)))
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_make_adapter_command_writes_what_peft_loads(make_model: Callable[..., Path], tmp_path: Path) -> None:
    base = make_model("llama", "tiny")
    out = tmp_path / "adapter"
    subprocess.run(
        [sys.executable, "-P", "-m", "kvfleet", "make-adapter", "--base", str(base), "--rank", "4", str(out)],
        check=True,
        capture_output=True,
    )
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    assert model.peft_config["default"].r == 4
    assert set(model.peft_config["default"].target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def _poison(adapter: Path, value: float) -> str:
    """Set one weight of the adapter to `value`; returns the tensor's name."""
    weights_file = adapter / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    name = sorted(tensors)[0]
    tensors[name][0, 0] = value
    save_file(tensors, weights_file)
    return name


def test_non_finite_adapters_are_refused_and_base_requests_beside_them_match(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    """NaN or infinite weights, config numbers, or a scaling that overflows, each named; the base request of
    the same batch gives Transformers' tokens."""
    base = make_model("llama", "tiny")
    nan_weight = make_adapter(base, tmp_path / "nan-weight", rank=4)
    nan_name = _poison(nan_weight, float("nan"))
    inf_weight = make_adapter(base, tmp_path / "inf-weight", rank=4)
    inf_name = _poison(inf_weight, float("-inf"))
    nan_alpha = make_adapter(base, tmp_path / "nan-alpha", rank=4)
    config = json.loads((nan_alpha / "adapter_config.json").read_text())
    (nan_alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    overflow = make_adapter(base, tmp_path / "overflow", rank=4)
    (overflow / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e308}))
    cases = {
        nan_weight: f"{nan_name} holds NaN or infinite values",
        inf_weight: f"{inf_name} holds NaN or infinite values",
        nan_alpha: "lora_alpha must be a finite number",
        overflow: "lora_B .scaled by lora_alpha / r. overflows torch.float32",
    }
    expected = _peft_tokens(base, None, [PROMPTS[0]])[0]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, (path, message) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate(
                [PROMPTS[0], PROMPTS[0]],
                params,
                lora_request=[None, LoRARequest("bad", index + 1, str(path))],
            )
        outputs = llm.generate([PROMPTS[0]], params)
        assert outputs[0].outputs[0].token_ids == expected, path.name


def test_a_removed_adapter_leaves_its_slot_zeroed(make_model: Callable[..., Path], tmp_path: Path) -> None:
    base = make_model("llama", "tiny")
    adapter = make_adapter(base, tmp_path / "adapter", rank=4)
    llm = LLM(
        str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=4,
        num_gpu_blocks_override=256,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    manager = llm.llm_engine.runner.lora_manager
    projections = [module for layer in manager.layers for module in layer.values()]

    llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("adapter", 1, str(adapter)))
    assert any(module.lora_b.any() for module in projections)
    llm.llm_engine.remove_lora(1)
    outputs = llm.generate([PROMPTS[0]], params)

    assert not any(module.lora_a.any() or module.lora_b.any() for module in projections)
    assert outputs[0].outputs[0].token_ids == _peft_tokens(base, None, [PROMPTS[0]])[0]
