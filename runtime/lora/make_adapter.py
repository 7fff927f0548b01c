"""Random PEFT LoRA adapters for a model folder: for tests, demos and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kvfleet.runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, projection_sizes
from kvfleet.runtime.models.model_config import ModelConfig
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def make_adapter(
    base: str | Path,
    out_dir: str | Path,
    *,
    rank: int,
    alpha: float | None = None,
    target_modules: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` for the model at `base`.

    Unlike a freshly initialised PEFT adapter (B = 0, no effect), both matrices are random, sized so that
    the adapter visibly changes what the model generates.
    """
    if rank < 1:
        raise ValueError("rank must be at least 1")
    unknown = sorted(set(target_modules) - set(ALL_TARGETS))
    if unknown or not target_modules:
        raise ValueError(f"target modules must be among {', '.join(ALL_TARGETS)}; got {unknown or 'none'}")
    config = ModelConfig.from_folder(base)
    sizes = projection_sizes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part in target_modules:
            in_features, out_features = sizes[part]
            parent = "self_attn" if part in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{part}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=generator) / rank**0.5
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / WEIGHTS_FILE))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base).resolve()),
        "r": rank,
        "lora_alpha": alpha if alpha is not None else rank,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_rslora": use_rslora,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
