"""The mixture-of-experts numbers of a Mixtral or Qwen3-MoE config.json, checked where they are read, and the
report of how a layer's router spread its tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> the config.json key of its experts' width.
MOE_MODEL_TYPES = {"mixtral": "intermediate_size", "qwen3_moe": "moe_intermediate_size"}


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    # Experts each token is routed to (top-k of the router's softmax).
    num_experts_per_tok: int
    # Width of one expert's gate/up projections.
    moe_intermediate_size: int
    # Whether the top-k probabilities are renormalised to sum to one (Mixtral always; Qwen3-MoE by config).
    norm_topk_prob: bool
    # Whether the routing weights are cast to the activations' dtype before they scale the experts' outputs
    # (Qwen3-MoE's order) rather than after, in float32 (Mixtral's).
    routing_weights_in_activation_dtype: bool
    # For each layer, whether its MLP is the experts' block (Qwen3-MoE may keep some layers dense).
    sparse_layers: tuple[bool, ...]


def moe_config(raw: dict[str, Any], num_layers: int, source: str) -> MoeConfig | None:
    """The MoE part of a config, or None for a dense model. Raises ValueError naming the field at fault."""
    model_type = raw.get("model_type", "")
    if model_type not in MOE_MODEL_TYPES:
        return None
    # Transformers writes Qwen3-MoE's num_experts as num_local_experts (an attribute alias); published
    # configs carry num_experts.
    experts_key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    width_key = MOE_MODEL_TYPES[model_type]
    for key in (experts_key, "num_experts_per_tok", width_key):
        if raw.get(key) is None:
            raise ValueError(f"{source}: missing {key!r}")
    num_experts = int(raw[experts_key])
    top_k = int(raw["num_experts_per_tok"])
    width = int(raw[width_key])
    if num_experts < 1:
        raise ValueError(f"{source}: {experts_key} must be positive, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{source}: num_experts_per_tok {top_k} must be between 1 and {experts_key} ({num_experts})"
        )
    if width < 1:
        raise ValueError(f"{source}: {width_key} must be positive, got {width}")
    if model_type == "mixtral":
        return MoeConfig(num_experts, top_k, width, True, False, (True,) * num_layers)
    return MoeConfig(
        num_experts,
        top_k,
        width,
        bool(raw.get("norm_topk_prob", False)),
        True,
        _qwen3_sparse_layers(raw, num_layers, source),
    )


def _qwen3_sparse_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Transformers' rule: a layer is sparse unless listed in mlp_only_layers, and only every
    decoder_sparse_step-th layer (counting from one) is."""
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"{source}: decoder_sparse_step must be positive, got {step}")
    dense = raw.get("mlp_only_layers") or []
    outside = [layer for layer in dense if not 0 <= int(layer) < num_layers]
    if outside:
        raise ValueError(f"{source}: mlp_only_layers names layers {outside} outside [0, {num_layers})")
    return tuple(layer not in dense and (layer + 1) % step == 0 for layer in range(num_layers))


@dataclass(frozen=True)
class MoeLayerLoad:
    """A mixture-of-experts layer's routing since the model was loaded: token-expert pairs routed (a token
    counts once for each of its top-k experts), and those of the busiest expert."""

    layer: int
    num_experts: int
    routed_tokens: int
    busiest_expert_tokens: int
