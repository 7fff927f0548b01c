"""Model folder -> ready model: config.json, the registry's class, safetensors weights (single or sharded)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.models.layers import pack_linears_for_cpu
from kvfleet.runtime.models.model_config import DTYPES, ModelConfig
from kvfleet.runtime.models.registry import ModelRegistry
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` follows config.json, except that half precision on the CPU runs in float32 (faster there)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cpu" and model_config.dtype != torch.float32:
        return torch.float32
    return model_config.dtype


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return found


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    model_config: ModelConfig,
    attention: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    registry: ModelRegistry | None = None,
) -> nn.Module:
    """Build the registered class for the config's architecture and fill it from the folder's weights."""
    model_dir = Path(model_dir)
    model_class = (registry or ModelRegistry()).resolve(model_config.architecture)
    files = safetensors_files(model_dir)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(model_config, attention, max_position)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        model.load_weights(iterate_weights(files))
    num_parameters = sum(p.numel() for p in model.parameters())
    packed = pack_linears_for_cpu(model) if device.type == "cpu" else 0
    logger.info(
        "loaded %s from %s: %.1fM parameters, %s on %s%s",
        model_config.architecture,
        model_dir,
        num_parameters / 1e6,
        str(dtype).removeprefix("torch."),
        device,
        f", {packed} projections packed for oneDNN" if packed else "",
    )
    return model.eval()
