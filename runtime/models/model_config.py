"""A Hugging Face config.json read into the few numbers a Llama-family model needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from kvfleet.runtime.hf_config import config_source, read_hf_config
from kvfleet.runtime.models.moe_config import MoeConfig, moe_config
from kvfleet.runtime.models.registry import REFUSED_ARCHITECTURES
from kvfleet.runtime.models.rope import rope_parameters

# Language models of Qwen2's graph: q/k/v biases and no o_proj bias (Qwen2.5-Omni's thinker names its own).
QWEN2_MODEL_TYPES = ("qwen2", "qwen2_5_omni_text")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any] = field(hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Each layer's attention window (a query sees the `window` latest positions, its own included), or None
    # where a layer attends to the whole context.
    layer_windows: tuple[int | None, ...] = ()
    dtype: torch.dtype = torch.float32
    # Mixture-of-experts models' experts and routing; None for dense models.
    moe: MoeConfig | None = None
    # A multimodal model's whole config.json (its encoders' settings); the fields above describe its language
    # model. None for text-only models.
    multimodal: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # config.json's quantization_config as written (read by kvfleet.runtime.quantization), None for float.
    quantization_config: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @classmethod
    def from_folder(cls, model_dir: str | Path, hf_overrides: Mapping[str, Any] | None = None) -> ModelConfig:
        """The folder's config.json, with vLLM's hf_overrides applied (an error names both)."""
        raw = read_hf_config(model_dir, hf_overrides)
        return cls.from_dict(raw, source=config_source(model_dir, hf_overrides))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(f"{source}: 'architectures' must name exactly one class, got {architectures!r}")
        if architectures[0] in REFUSED_ARCHITECTURES:
            raise ValueError(f"{source}: {REFUSED_ARCHITECTURES[architectures[0]]}")
        if isinstance(raw.get("text_config"), dict):
            # A multimodal model (LLaVA): the language model's numbers, under the model's own architecture.
            text = {
                "model_type": "llama",
                "dtype": raw.get("dtype") or raw.get("torch_dtype"),
                **raw["text_config"],
            }
            text["architectures"] = architectures
            return replace(cls.from_dict(text, f"{source} text_config"), multimodal=raw)

        def require(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"{source}: missing {key!r}")
            return raw[key]

        model_type = raw.get("model_type", "")
        hidden_size = int(require("hidden_size"))
        num_heads = int(require("num_attention_heads"))
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of {num_kv_heads} KV heads"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ValueError(f"{source}: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
        # Qwen2 always has q/k/v biases; Llama may ask for them (and for an o_proj bias, which it shares).
        attention_bias = model_type in QWEN2_MODEL_TYPES or bool(raw.get("attention_bias", False))
        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias is not supported")
        return cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=int(require("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(require("intermediate_size")),
            num_hidden_layers=int(require("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=rope_parameters(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            layer_windows=_layer_windows(raw, int(require("num_hidden_layers")), source),
            dtype=DTYPES[dtype_name],
            moe=moe_config(raw, int(require("num_hidden_layers")), source),
            quantization_config=raw.get("quantization_config"),
        )

    @property
    def uses_mrope(self) -> bool:
        """Whether tokens are rotated by three positions (M-RoPE), which the engine computes per request."""
        return "mrope_section" in self.rope

    @property
    def o_proj_bias(self) -> bool:
        return self.model_type not in QWEN2_MODEL_TYPES and self.attention_bias

    @property
    def max_context(self) -> int:
        """The longest context: the positions RoPE scaling reaches (vLLM's rule: `linear` and `dynamic`
        stretch max_position_embeddings by their factor, `yarn` the original length; the others declare the
        scaled length as max_position_embeddings)."""
        rope_type = self.rope["rope_type"]
        if rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * float(self.rope["factor"]))
        if rope_type == "yarn":
            return int(self.rope["original_max_position_embeddings"] * float(self.rope["factor"]))
        return self.max_position_embeddings

    @property
    def sliding_window(self) -> int | None:
        """The window that bounds what a request needs kept: the widest, when every layer has one."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)


def _layer_windows(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    """Mistral slides every layer over `sliding_window`; Qwen2/3 only with use_sliding_window, and then the
    layers from max_window_layers on, unless `layer_types` names each layer's kind (as Transformers reads)."""
    window = raw.get("sliding_window")
    if window is None or ("use_sliding_window" in raw and not raw["use_sliding_window"]):
        return (None,) * num_layers
    window = int(window)
    if window < 1:
        raise ValueError(f"{source}: sliding_window must be positive, got {window}")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"{source}: layer_types names {len(layer_types)} layers, not {num_layers}")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if "max_window_layers" in raw and raw.get("model_type") != "qwen3_moe":  # Qwen3-MoE slides every layer
        first_sliding = int(raw["max_window_layers"])
        return tuple(window if i >= first_sliding else None for i in range(num_layers))
    return (window,) * num_layers
