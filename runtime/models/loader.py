"""Model folder -> ready model: config.json, the registry's class, safetensors weights (single or sharded)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.distributed.parallel import parallel_context
from kvfleet.runtime.models.layers import pack_linears_for_cpu
from kvfleet.runtime.models.model_config import DTYPES, ModelConfig
from kvfleet.runtime.models.registry import ModelRegistry
from kvfleet.runtime.quantization.config import weight_quantization
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
# One line for every shard read, never redrawn in place: the engine core's stderr is the server's log, where
# a bar drawn with carriage returns would run into the log records between its updates.
_SHARDS_BAR_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed} elapsed, {remaining} left]\n"


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


@dataclass
class LoadStats:
    """What loading held in memory: the model's parameters, and the largest tensor read from the checkpoint
    at once (the load buffer: with parallelism, the largest slice this rank reads)."""

    parameter_bytes: int = 0
    peak_buffer_bytes: int = 0


def iterate_weights(
    files: list[Path], model: nn.Module, stats: LoadStats, *, use_tqdm: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, or just the slices the model holds when it says which
    (`checkpoint_slice(name, shape)`, None for a tensor it holds none of): only those bytes are read.
    `use_tqdm`: a progress bar on stderr counts the shards read."""
    choose = getattr(model, "checkpoint_slice", None)
    shards = tqdm(
        files,
        desc="Loading safetensors checkpoint shards",
        disable=not use_tqdm,
        bar_format=_SHARDS_BAR_FORMAT,
        mininterval=0,
        miniters=1,
    )
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if choose is None:
                    tensor = f.get_tensor(name)
                else:
                    handle = f.get_slice(name)
                    part = choose(name, handle.get_shape())
                    if part is None:
                        continue
                    tensor = handle[part]
                stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, tensor.numel() * tensor.element_size())
                yield name, tensor


def load_model(
    model_dir: str | Path,
    model_config: ModelConfig,
    attention: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    use_tqdm: bool,
    registry: ModelRegistry | None = None,
    stats: LoadStats | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """Build the registered class for the config's architecture and fill it from the folder's weights.
    `stats`, when given, is filled with what loading held in memory. `use_tqdm`: the first rank shows the
    shards loading on a progress bar (the other ranks read the same shards at the same time).
    `quantization`: the method asked for (vLLM's names), checked against the folder's quantization_config."""
    model_dir = Path(model_dir)
    model_class = (registry or ModelRegistry()).resolve(model_config.architecture)
    parallel = parallel_context()
    if parallel.tp_size * parallel.pp_size > 1 and not hasattr(model_class, "checkpoint_slice"):
        raise ValueError(
            f"{model_config.architecture} ({model_class.__name__}) cannot be split between ranks: it does "
            "not say which slice of each checkpoint tensor a rank holds (checkpoint_slice)"
        )
    scheme = weight_quantization(
        model_config.quantization_config, quantization, str(model_dir / "config.json")
    )
    files = safetensors_files(model_dir)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(model_config, attention, max_position)
    finally:
        torch.set_default_dtype(default_dtype)
    stats = stats or LoadStats()
    weights = iterate_weights(files, model, stats, use_tqdm=use_tqdm and parallel.rank == 0)
    checkpoint = None
    if scheme is not None:
        from kvfleet.runtime.quantization.linear import QuantizedCheckpoint

        checkpoint = QuantizedCheckpoint(scheme, files)
        with torch.device(device):
            checkpoint.replace_linears(model, dtype)
        weights = checkpoint.tensors(weights)
    with torch.no_grad():
        model.load_weights(weights)
    if checkpoint is not None:
        checkpoint.check_loaded(model)
        if device.type == "cpu":
            checkpoint.pack_for_cpu(model)
    num_parameters = sum(p.numel() for p in model.parameters())
    stats.parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
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
    if scheme is not None:
        logger.info("quantized checkpoint: %s", scheme.describe())
    return model.eval()
