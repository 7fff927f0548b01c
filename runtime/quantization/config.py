"""What a model folder's `quantization_config` (config.json) says about its weights, read without torch.

kvfleet loads weight-only checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM
serves): int8 and int4 weights with per-channel or per-group scales (`pack-quantized`, `int-quantized`) and
float8 weights with per-tensor or per-channel scales (`float-quantized`). Anything else is refused with the
config field that names it. `--quantization` takes vLLM's method names: given, it must agree with the folder;
absent, the folder's method is taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.contract.engine import LOADED_QUANTIZATION_METHODS
from kvfleet.runtime.hf_config import config_source, read_hf_config

# vLLM's `--quantization` names; kvfleet loads the contract's, and refuses the others by name.
QUANTIZATION_METHODS = (
    *LOADED_QUANTIZATION_METHODS,
    "fp8",
    "gptq",
    "gptq_marlin",
    "awq",
    "awq_marlin",
    "bitsandbytes",
    "gguf",
    "modelopt",
    "modelopt_fp4",
    "mxfp4",
    "torchao",
    "quark",
    "fbgemm_fp8",
    "experts_int8",
    "moe_wna16",
    "ptpc_fp8",
    "inc",
)
# Kernel variants of one checkpoint format that vLLM names apart.
_SAME_FORMAT = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# Why a format kvfleet does not load is refused, where there is more to say than its name.
_WHY_NOT = {
    "gptq": "GPTQ checkpoints (qweight/qzeros/scales/g_idx, activation-order permutations) are not loaded; "
    "llm-compressor converts them to compressed-tensors W4A16, which is",
    "awq": "AWQ checkpoints (qweight/qzeros/scales packed in AWQ's interleaved order) are not loaded; "
    "llm-compressor converts them to compressed-tensors W4A16, which is",
    "fp8": "vLLM's own fp8 checkpoints (block-wise weight_scale_inv) are not loaded, nor are float weights "
    "quantized at load; compressed-tensors FP8 checkpoints are",
}
# vLLM's --kv-cache-dtype values.
KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "int8",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
)
_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightQuantization:
    """One weight-only scheme for every quantized projection of a checkpoint."""

    type: str  # "int" or "float"
    num_bits: int
    strategy: str  # "channel", "group" or "tensor"
    group_size: int | None  # for "group"
    format: str  # compressed-tensors' storage format

    @property
    def packed(self) -> bool:
        """Whether the weight is stored as `weight_packed` int32 words (else as `weight` itself)."""
        return self.format == "pack-quantized"

    def describe(self) -> str:
        kind = f"{self.type}{self.num_bits}"
        granularity = f"groups of {self.group_size}" if self.strategy == "group" else self.strategy
        return f"{kind} weights, {granularity} scales ({self.format})"


def check_quantization_method(requested: str | None) -> None:
    """Raises ValueError unless `requested` is None or a method name vLLM knows."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {requested!r} is not a method vLLM names; kvfleet loads compressed-tensors "
            "checkpoints"
        )


def kv_cache_dtype_refusal(kv_cache_dtype: str) -> str | None:
    """Why kvfleet cannot keep the KV cache in `kv_cache_dtype` (vLLM's names), or None for `auto`."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"{kv_cache_dtype!r} is not one of vLLM's KV cache dtypes ({', '.join(KV_CACHE_DTYPES)})"
    if kv_cache_dtype.startswith(("fp8", "int8")):
        return (
            f"{kv_cache_dtype!r}: a quantized KV cache is not supported: the attention backends read and "
            "write the cache in the activations' dtype (and CPUs have no float8 arithmetic); use auto"
        )
    return f"{kv_cache_dtype!r}: the KV cache is kept in the model's dtype (auto) only"


def weight_quantization(
    quantization_config: dict[str, Any] | None, requested: str | None, source: str = "config.json"
) -> WeightQuantization | None:
    """The scheme of a folder's `quantization_config` (None for a float checkpoint), checked against the
    `--quantization` asked for. Raises ValueError naming the field that kvfleet cannot load."""
    check_quantization_method(requested)
    if quantization_config is None:
        if requested is not None:
            raise ValueError(
                f"quantization {requested!r} was asked for, but {source} has no quantization_config: kvfleet "
                "serves checkpoints quantized ahead of time (kvfleet make-model --quantize writes them)"
            )
        return None
    if not isinstance(quantization_config, dict):
        raise ValueError(f"{source}: quantization_config must be an object")
    method = quantization_config.get("quant_method")
    if requested is not None and _SAME_FORMAT.get(requested, requested) != method:
        raise ValueError(
            f"quantization {requested!r} was asked for, but {source} quantization_config.quant_method is "
            f"{method!r}"
        )
    if method not in LOADED_QUANTIZATION_METHODS:
        reason = _WHY_NOT.get(str(method), "only compressed-tensors checkpoints are")
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not supported: {reason}")
    return _compressed_tensors_scheme(quantization_config, f"{source}: quantization_config")


def folder_weight_quantization(
    model_dir: str | Path, requested: str | None, hf_overrides: Mapping[str, Any] | None = None
) -> WeightQuantization | None:
    """weight_quantization of a folder's config.json (after vLLM's hf_overrides); None for a folder without a
    readable one (the folder check and the loader refuse those with their own reasons)."""
    check_quantization_method(requested)
    try:
        raw = read_hf_config(model_dir, hf_overrides)
    except (OSError, ValueError):
        return None
    source = config_source(model_dir, hf_overrides)
    return weight_quantization(raw.get("quantization_config"), requested, source)


def _compressed_tensors_scheme(config: dict[str, Any], field: str) -> WeightQuantization:
    if config.get("kv_cache_scheme") is not None:
        raise ValueError(
            f"{field}.kv_cache_scheme: a quantized KV cache is not supported (it is kept in float)"
        )
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{field}.config_groups must name at least one scheme")
    schemes = {
        _group_scheme(group, config, f"{field}.config_groups.{name}") for name, group in groups.items()
    }
    if len(schemes) > 1:
        raise ValueError(f"{field}.config_groups: groups of different schemes are not supported")
    return schemes.pop()


def _group_scheme(group: Any, config: dict[str, Any], field: str) -> WeightQuantization:
    if not isinstance(group, dict):
        raise ValueError(f"{field} must be an object (a preset scheme's name is not read)")
    for activations in ("input_activations", "output_activations"):
        if group.get(activations) is not None:
            raise ValueError(
                f"{field}.{activations}: quantized activations are not supported (weight-only schemes are)"
            )
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{field}.weights: a weight-only scheme needs its weights' settings")
    compression_format = group.get("format") or config.get("format")
    kind, num_bits = weights.get("type"), weights.get("num_bits")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if kind == "int":
        if num_bits not in (4, 8):
            raise ValueError(f"{field}.weights.num_bits: int{num_bits} is not supported (int4 and int8 are)")
        if strategy not in ("channel", "group"):
            raise ValueError(f"{field}.weights.strategy: {strategy!r} is not supported for int weights")
        formats = _INT_FORMATS if num_bits == 8 else ("pack-quantized",)
    elif kind == "float":
        if num_bits != 8:
            raise ValueError(f"{field}.weights.num_bits: float{num_bits} is not supported (float8 is)")
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"{field}.weights.strategy: {strategy!r} is not supported for float8 weights")
        formats = _FLOAT_FORMATS
    else:
        raise ValueError(f"{field}.weights.type: {kind!r} is not a weight type kvfleet loads (int, float)")
    if compression_format not in formats:
        raise ValueError(
            f"{field}: format {compression_format!r} is not supported for {kind}{num_bits} weights "
            f"({', '.join(formats)})"
        )
    if weights.get("symmetric") is False:
        raise ValueError(f"{field}.weights.symmetric: asymmetric weights (zero points) are not supported")
    if weights.get("dynamic"):
        raise ValueError(f"{field}.weights.dynamic: weights must be quantized ahead of time")
    if weights.get("actorder") in ("group", "dynamic", True):
        raise ValueError(
            f"{field}.weights.actorder: activation ordering by group (a weight_g_idx per projection) is not "
            "supported; 'weight' ordering, which leaves the weights in order, is"
        )
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise ValueError(f"{field}.weights.group_size must be a positive integer for the group strategy")
    return WeightQuantization(
        type=kind,
        num_bits=num_bits,
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
        format=compression_format,
    )
