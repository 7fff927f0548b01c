"""A made model's projections quantized into the compressed-tensors format, with that library's own code.

The schemes are llm-compressor's preset names, lower-cased, for what a weight-only checkpoint holds: `w8a16`
(int8, one scale per output channel: the format kvfleet's fused CPU matmul reads), `w4a16` (int4, one scale
per group of input columns, packed eight to an int32) and `fp8` (float8 e4m3 weights, one scale per output
channel, activations left in float: what vLLM serves as W8A16-FP8). Activations are never quantized. A
mixture-of-experts model's experts are quantized one by one, as llm-compressor quantizes them, and its routers
stay in float, as its recipes leave them. The embedding stays in float. So does the LM head, as
llm-compressor's recipes leave it, unless `lm_head` asks for it too: every decode step reads it whole (the
`small` preset's is 16.8 MB of float32, beside 22.5 MB of int8 projections). kvfleet and Transformers load
such a folder; vLLM's compressed-tensors loader has refused a quantized LM head.

compressed-tensors is imported only here, when a quantized folder is made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.make_model.files import save_weights, write_json

SCHEMES = ("w8a16", "w4a16", "fp8")
# Group sizes tried for w4a16, largest first: llm-compressor's default is 128; a smaller preset's widths are
# not all multiples of it.
_GROUP_SIZES = (128, 64, 32, 16)
# The checkpoint's projections in the layers, a Mixtral expert's w1/w2/w3 among them (the LM head is
# quantized only when asked).
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# A mixture-of-experts router (Qwen3-MoE's `mlp.gate`, Mixtral's `block_sparse_moe.gate`), as the ignore list
# of llm-compressor's recipes names it: loaders that quantize every Linear but those ignored must skip it.
_ROUTER = r"re:.*(mlp|block_sparse_moe)\.gate$"


def quantize_folder(folder: Path, scheme_name: str, *, lm_head: bool = False) -> None:
    """Rewrite a float model folder's weights (one model.safetensors) quantized, the LM head too with
    `lm_head`; config.json says how."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{folder} is quantized already")
    weights = load_file(folder / "model.safetensors")
    if lm_head and "lm_head.weight" not in weights:
        raise ValueError(f"{folder} has no LM head of its own to quantize (its embedding is tied to it)")
    dtype_name = config.get("dtype") or "float32"
    tensors, quantization_config = quantize_weights(weights, scheme_name, dtype_name, lm_head=lm_head)
    save_weights(folder / "model.safetensors", tensors, None)
    write_json(folder / "config.json", {**config, "quantization_config": quantization_config})


def quantize_weights(
    tensors: dict[str, Any], scheme_name: str, dtype_name: str, *, lm_head: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(compressed tensors, config.json's `quantization_config`) of a float checkpoint's tensors, the LM
    head's too with `lm_head`; those that stay in float are cast to `dtype_name`, scales too."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    if scheme_name not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme_name!r}; choose from {', '.join(SCHEMES)}")
    dtype = getattr(torch, dtype_name)
    projections = {
        n: t
        for n, t in tensors.items()
        if n.endswith(tuple(f".{p}.weight" for p in _PROJECTIONS)) or (lm_head and n == "lm_head.weight")
    }
    scheme, compression_format = _scheme(scheme_name, [t.shape[1] for t in projections.values()])
    compressor = BaseCompressor.get_value_from_registry(compression_format)
    out = {n: t.to(dtype) for n, t in tensors.items() if n not in projections}
    args = scheme.weights
    for name, weight in projections.items():
        weight = weight.to(dtype)
        grouped = weight.float()
        if args.group_size is not None:
            grouped = grouped.reshape(weight.shape[0], -1, args.group_size)
        low = grouped.amin(dim=-1, keepdim=args.group_size is None)
        high = grouped.amax(dim=-1, keepdim=args.group_size is None)
        scale, _ = calculate_qparams(low, high, args)
        module_state = {"weight": weight, "weight_scale": scale.to(dtype)}
        prefix = name.removesuffix("weight")
        for key, value in compressor.compress(module_state, scheme).items():
            out[prefix + key] = value.contiguous()
    routers = any(n.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")) for n in tensors)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=compression_format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=([] if lm_head else ["lm_head"]) + ([_ROUTER] if routers else []),
    )
    return out, config.to_dict()


def _scheme(scheme_name: str, in_features: list[int]) -> tuple[Any, str]:
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )

    channel = {"strategy": QuantizationStrategy.CHANNEL, "symmetric": True, "dynamic": False}
    if scheme_name == "w8a16":
        weights = QuantizationArgs(num_bits=8, type=QuantizationType.INT, **channel)
        compression_format = "pack-quantized"
    elif scheme_name == "w4a16":
        group_size = next((g for g in _GROUP_SIZES if all(n % g == 0 for n in in_features)), None)
        if group_size is None:
            raise ValueError(f"w4a16 needs input widths divisible by 16, got {sorted(set(in_features))}")
        weights = QuantizationArgs(
            num_bits=4,
            type=QuantizationType.INT,
            strategy=QuantizationStrategy.GROUP,
            group_size=group_size,
            symmetric=True,
            dynamic=False,
        )
        compression_format = "pack-quantized"
    else:
        weights = QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, **channel)
        compression_format = "float-quantized"
    return QuantizationScheme(targets=["Linear"], weights=weights), compression_format
