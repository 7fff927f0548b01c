"""A text model's config.json and its random weights, for the Llama, Mistral, Qwen and Mixtral families."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.models.make_model.tokenizer import TokenizerStyle
from kvfleet.runtime.models.moe_config import moe_config

# Each text architecture: its Transformers class and model_type.
TEXT_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Mixture-of-experts presets: every preset's layers get this many experts, each token this many of them.
_NUM_EXPERTS = 8
_EXPERTS_PER_TOKEN = 2


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 176, 1024, 2048),
    "small": Preset(512, 8, 8, 2, 1408, 8192, 2048),
    # A draft model for `small` in speculative decoding: the same vocabulary (hence the same tokenizer), a
    # sixteenth of the layers' width and a quarter of their number.
    "small-draft": Preset(128, 2, 4, 2, 352, 8192, 2048),
}

_INIT_STD = 0.02
# Standard deviations of attention scores and of logits that the random weights aim for.
_ATTENTION_SCORE_STD = 2.0
_LOGIT_STD = 2.5
# Projections that read the hidden state (their column 0 is zeroed), and those that write it (their row 0).
_READ_FROM_HIDDEN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_READ_FROM_HIDDEN += (".w1.weight", ".w3.weight")  # Mixtral's experts' gate and up
_WRITTEN_TO_HIDDEN = ("o_proj.weight", "down_proj.weight", ".w2.weight")
# Weight on the constant hidden dimension for ids the tokenizer lacks (see _suppress_unused_ids).
_UNUSED_ID_WEIGHT = -100.0


def text_config(
    arch: str, spec: Preset, style: TokenizerStyle, special_ids: dict[str, int], dtype: str
) -> dict[str, Any]:
    architecture, model_type = TEXT_ARCHITECTURES[arch]
    head_dim = spec.hidden_size // spec.num_attention_heads
    if arch.startswith("qwen3") and spec.hidden_size < 256:
        head_dim *= 2  # Qwen3's head_dim is independent of hidden_size; exercise that on the tiny preset
    eos_ids = [special_ids[style.eos_token], special_ids[style.end_of_text]]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": _INIT_STD,
        "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids.get(style.bos_token) if style.bos_token else None,
        "eos_token_id": eos_ids[0] if arch.startswith("qwen") else eos_ids,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }
    if arch == "llama":
        # Llama 3.1 scaling with a short original context, so the scaled band falls inside short prompts too.
        config["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings // 8,
        }
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    if arch == "mistral":
        config["sliding_window"] = None
    if arch.startswith("qwen"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_hidden_layers)
    if arch.startswith("qwen3"):
        config["attention_bias"] = False
    if arch == "mixtral":
        # Each expert is as wide as the dense MLP would be (intermediate_size), as in Mixtral's own configs.
        config.update(
            num_local_experts=_NUM_EXPERTS,
            num_experts_per_tok=_EXPERTS_PER_TOKEN,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    if arch == "qwen3-moe":
        # Narrower experts than the dense MLP, which the last layer keeps (mlp_only_layers); the top-k
        # probabilities are used as they are (norm_topk_prob false), the other way from Mixtral.
        del config["max_window_layers"]
        config.update(
            num_experts=_NUM_EXPERTS,
            num_experts_per_tok=_EXPERTS_PER_TOKEN,
            moe_intermediate_size=spec.intermediate_size // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[spec.num_hidden_layers - 1],
            norm_topk_prob=False,
        )
    return config


def random_weights(config: dict[str, Any], seed: int, *, num_used_ids: int) -> dict[str, Any]:
    """Random weights scaled so that activations stay near unit size, attention is selective (scores of a
    few units) and logits are peaked: greedy outputs then depend on the whole context, not the last token."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    head_dim = config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    query_key_std = (_ATTENTION_SCORE_STD / hidden) ** 0.5
    moe = moe_config(config, config["num_hidden_layers"], "config")
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, rows, std in (
            ("q_proj", q_rows, query_key_std),
            ("k_proj", kv_rows, query_key_std),
            ("v_proj", kv_rows, hidden**-0.5),
        ):
            tensors[f"{prefix}.self_attn.{name}.weight"] = normal(rows, hidden, std=std)
            if config["model_type"] == "qwen2":
                tensors[f"{prefix}.self_attn.{name}.bias"] = normal(rows, std=0.1)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_rows, std=q_rows**-0.5)
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(head_dim)
            tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(head_dim)
        if moe is not None and moe.sparse_layers[i]:
            tensors.update(
                _expert_weights(config, prefix, moe.num_experts, moe.moe_intermediate_size, normal)
            )
            continue
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter, std=inter**-0.5)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(vocab, hidden, std=_LOGIT_STD * hidden**-0.5)
    if num_used_ids < vocab:
        _suppress_unused_ids(tensors, num_used_ids)
    return tensors


def _expert_weights(
    config: dict[str, Any], prefix: str, num_experts: int, width: int, normal: Callable[..., Any]
) -> dict[str, Any]:
    """A sparse layer's router and experts, under the names Transformers 5 writes: Mixtral's w1 (gate), w3
    (up) and w2 (down) under block_sparse_moe, Qwen3-MoE's gate/up/down_proj under mlp. The router's logits
    come out near unit size, so that tokens spread over the experts."""
    hidden = config["hidden_size"]
    mixtral = config["model_type"] == "mixtral"
    block = f"{prefix}.block_sparse_moe" if mixtral else f"{prefix}.mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    tensors = {f"{block}.gate.weight": normal(num_experts, hidden, std=hidden**-0.5)}
    for expert in range(num_experts):
        gate, up, down = (f"{block}.experts.{expert}.{name}.weight" for name in names)
        tensors[gate] = normal(width, hidden, std=hidden**-0.5)
        tensors[up] = normal(width, hidden, std=hidden**-0.5)
        tensors[down] = normal(hidden, width, std=width**-0.5)
    return tensors


def _suppress_unused_ids(tensors: dict[str, Any], num_used_ids: int) -> None:
    """Make ids past the tokenizer's vocabulary (padding) unlikely, as training would.

    Hidden dimension 0 becomes a constant 1: every embedding holds it and no layer reads or writes that
    dimension, so after the final norm it is positive for every token (1 / rms of the last hidden state).
    The lm_head rows of unused ids weigh it negatively, which acts as a large negative bias.
    """
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    for name, tensor in tensors.items():
        if name.endswith(_READ_FROM_HIDDEN):
            tensor[:, 0] = 0.0
        elif name.endswith(_WRITTEN_TO_HIDDEN):
            tensor[0] = 0.0
    lm_head = tensors["lm_head.weight"]
    lm_head[:, 0] = 0.0
    lm_head[num_used_ids:, 0] = _UNUSED_ID_WEIGHT
