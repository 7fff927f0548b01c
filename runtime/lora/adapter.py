"""PEFT LoRA adapters read from their folder and laid out for the model's fused projections.

A PEFT adapter holds, per adapted projection, `lora_A` [r, in] and `lora_B` [out, r]; the model adds
`scaling * x @ A.T @ B.T` to the projection's output (scaling = alpha / r, or alpha / sqrt(r) for rsLoRA).
The model fuses q/k/v and gate/up into one matmul each, so their adapters are stacked the same way: the
slices' A matrices one above the other, and their B matrices one above the other too (each slice's rows of
the fused output take its own B). Scaling is folded into B.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.models.model_config import ModelConfig
from safetensors import SafetensorError, safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The model's fused projections and the checkpoint projections each is made of, in row order.
FUSED_SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass
class LoRAWeights:
    """One adapter, ready for the model: per layer, per fused projection, A [slices * max_rank, in] and
    B [out, max_rank], each slice's rank padded with zeros to `max_rank` so that every adapter fits the same
    slots."""

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


def projection_sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each checkpoint projection."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_digest(path: str | Path) -> str:
    """A digest of the adapter's files: what identifies its weights across processes and reloads."""
    folder = Path(path)
    hasher = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            hasher.update((folder / name).read_bytes())
        except OSError as exc:
            raise LoRAAdapterError(f"cannot read {name} of the adapter at {folder}: {exc.strerror}") from None
    return hasher.hexdigest()


def load_lora_weights(
    path: str | Path, config: ModelConfig, *, max_rank: int, dtype: torch.dtype
) -> LoRAWeights:
    """Read and check a PEFT adapter folder into host memory; raises LoRAAdapterError naming what does not
    fit."""
    folder = Path(path)
    adapter_config = _read_config(folder)
    rank = adapter_config["r"]
    if rank > max_rank:
        raise LoRAAdapterError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    alpha = adapter_config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAAdapterError("adapter_config.json: lora_alpha must be a number")
    scaling = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder, config, rank)
    sizes = projection_sizes(config)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for index in range(config.num_hidden_layers):
        fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for fused_name, slices in FUSED_SLICES.items():
            present = [(index, part) in tensors for part in slices]
            if not any(present):
                continue
            in_features = sizes[slices[0]][0]
            out_total = sum(sizes[part][1] for part in slices)
            a = torch.zeros(len(slices) * max_rank, in_features)
            b = torch.zeros(out_total, max_rank)
            row = 0
            for position, part in enumerate(slices):
                out_features = sizes[part][1]
                if (index, part) in tensors:
                    lora_a, lora_b = tensors[(index, part)]
                    first = position * max_rank
                    a[first : first + rank] = lora_a
                    b[row : row + out_features, :rank] = lora_b * scaling
                row += out_features
            fused[fused_name] = (
                _finite(a.to(dtype), f"layer {index} {fused_name} lora_A"),
                _finite(b.to(dtype), f"layer {index} {fused_name} lora_B (scaled by lora_alpha / r)"),
            )
        layers.append(fused)
    return LoRAWeights(layers)


def _finite(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor, if its values are still finite in the serving dtype: an adapter's update is added to the
    model's output, so a NaN or an infinity there would turn its tokens' text to nothing, and in the batched
    matmuls a value that is not finite times the zeros of other slots is NaN as well."""
    if not torch.isfinite(tensor).all():
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: {what} overflows {tensor.dtype} (NaN or infinite values)")
    return tensor


def _non_finite_number(value: object, where: str) -> str | None:
    """The first key of a JSON value that holds NaN or an infinity (Python's json reads NaN, Infinity and
    numbers like 1e999 as floats), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        found = _non_finite_number(child, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
        non_finite = _non_finite_number(raw, "")
    except OSError as exc:
        raise LoRAAdapterError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise LoRAAdapterError(f"{path} nests too deeply") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{path} must hold a JSON object")
    if non_finite is not None:
        raise LoRAAdapterError(f"adapter_config.json: {non_finite} must be a finite number")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"the adapter is {raw.get('peft_type')!r}; only LORA adapters are served")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError("adapter_config.json: r must be a positive integer")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in unsupported.items():
        if raw.get(key):
            raise LoRAAdapterError(f"adapters with {what} are not supported")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError("adapters that train biases are not supported (bias must be 'none')")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise LoRAAdapterError("adapters with per-module ranks (rank_pattern, alpha_pattern) are unsupported")
    return raw


def _read_tensors(
    folder: Path, config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
    """{(layer, projection): (lora_A, lora_B)}, each checked against the model's shapes."""
    path = folder / WEIGHTS_FILE
    sizes = projection_sizes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                match = _TENSOR_NAME.match(name)
                if match is None:
                    raise LoRAAdapterError(f"{WEIGHTS_FILE}: {name!r} is not a LoRA weight of this model")
                layer, parent, part, which = int(match[1]), match[2], match[3], match[4]
                if part not in sizes or _PARENT.get(part, "mlp") != parent:
                    raise LoRAAdapterError(f"{WEIGHTS_FILE}: the model has no projection {parent}.{part}")
                if layer >= config.num_hidden_layers:
                    raise LoRAAdapterError(
                        f"{WEIGHTS_FILE}: layer {layer} does not exist (the model has "
                        f"{config.num_hidden_layers})"
                    )
                tensor = weights.get_tensor(name).float()
                if not torch.isfinite(tensor).all():
                    raise LoRAAdapterError(f"{WEIGHTS_FILE}: {name} holds NaN or infinite values")
                found.setdefault((layer, part), {})[which] = tensor
    except FileNotFoundError:
        raise LoRAAdapterError(f"{path} does not exist") from None
    except (SafetensorError, OSError) as exc:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    if not found:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    tensors: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
    for (layer, part), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: layer {layer} {part} needs both lora_A and lora_B")
        in_features, out_features = sizes[part]
        if pair["A"].shape != (rank, in_features) or pair["B"].shape != (out_features, rank):
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: layer {layer} {part} has lora_A {tuple(pair['A'].shape)} and lora_B "
                f"{tuple(pair['B'].shape)}; this model and rank {rank} need {(rank, in_features)} and "
                f"{(out_features, rank)} (an adapter of another base model?)"
            )
        tensors[(layer, part)] = (pair["A"], pair["B"])
    return tensors
