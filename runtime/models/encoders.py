"""What multimodal models share: a bidirectional pre-norm transformer layer (CLIP's and Whisper's), and
`ConditionalGeneration`, encoders in front of a Llama-family language model over the paged KV cache.

Items are encoded apart from the decoder (`embed_multimodal`, batched per modality); the model runner puts
each item's embeddings in place of its placeholder tokens and hands the decoder `inputs_embeds`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.models.layers import copy_checkpoint_tensor
from kvfleet.runtime.models.llama import LlamaForCausalLM
from kvfleet.runtime.models.model_config import ModelConfig
from torch import nn
from torch.nn import functional


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": _quick_gelu, "gelu": functional.gelu}


def activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class EncoderLayer(nn.Module):
    """Pre-norm self-attention where every position sees every unmasked one, then a two-layer MLP; under
    CLIP's parameter names (Whisper's checkpoints are renamed to them)."""

    def __init__(
        self,
        width: int,
        inner: int,
        num_heads: int,
        eps: float,
        activation_name: str,
        *,
        key_bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(width, width),
                "k_proj": nn.Linear(width, width, bias=key_bias),
                "v_proj": nn.Linear(width, width),
                "out_proj": nn.Linear(width, width),
            }
        )
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(width, inner), "fc2": nn.Linear(inner, width)})
        self.activation = activation(activation_name)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [items, positions, width]; key_mask: [items, positions], True where a position may be
        attended to (all when None)."""
        items, positions, width = x.shape
        normed = self.layer_norm1(x)
        heads = [
            self.self_attn[name](normed).view(items, positions, self.num_heads, -1).transpose(1, 2)
            for name in ("q_proj", "k_proj", "v_proj")
        ]
        mask = None if key_mask is None else key_mask[:, None, None, :]
        attended = functional.scaled_dot_product_attention(*heads, attn_mask=mask)
        x = x + self.self_attn["out_proj"](attended.transpose(1, 2).reshape(items, positions, width))
        return x + self.mlp["fc2"](self.activation(self.mlp["fc1"](self.layer_norm2(x))))


class ConditionalGeneration(nn.Module, ABC):
    """A language model (`language_model`, a LlamaForCausalLM) behind a model's encoders. Subclasses build
    their encoders, provide `embed_multimodal(modality, data, unpadded_lengths) -> one [tokens, hidden]
    tensor per item`, and say where their encoders' checkpoint tensors go (`_encoder_parameter`)."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__()
        if config.multimodal is None:
            raise ValueError(f"{config.architecture} needs config.json's encoder settings")
        self.config = config
        self.language_model = LlamaForCausalLM(config, attention, max_position)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: Any,
        **inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, plan, **inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoints in Transformers 5's layout (`model.language_model.`, `model.<encoder>.`, `lm_head.`)
        or the older one (`language_model.model.`, `<encoder>.`, `language_model.lm_head.`). Raises
        ValueError naming the tensor for unknown names, wrong shapes or missing ones."""
        params = dict(self.named_parameters())
        encoder_loaded: set[str] = set()

        def encoder_tensor(hf_name: str, name: str, tensor: torch.Tensor) -> None:
            self._load_encoder_tensor(hf_name, name, tensor, params, encoder_loaded)

        self.language_model.load_weights(self._language_weights(weights, encoder_tensor))
        missing = sorted(
            name for name in params if not name.startswith("language_model.") and name not in encoder_loaded
        )
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} encoder tensors, e.g. {', '.join(missing[:4])}"
            )

    def _language_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        encoder_tensor: Callable[[str, str, torch.Tensor], None],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors under a text model's names; every other tensor goes to
        encoder_tensor(checkpoint name, name without `model.`, tensor)."""
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.startswith("language_model."):
                inner = name.removeprefix("language_model.")
                yield (
                    (inner if inner.startswith("lm_head.") else "model." + inner.removeprefix("model.")),
                    tensor,
                )
            elif name.startswith("lm_head."):
                yield name, tensor
            else:
                encoder_tensor(hf_name, name, tensor)

    @abstractmethod
    def _encoder_parameter(self, name: str) -> str | None:
        """The parameter a checkpoint tensor of the encoders (its name without `model.`) goes to, or None
        for one the model does not use."""

    def _load_encoder_tensor(
        self, hf_name: str, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], loaded: set[str]
    ) -> None:
        target = self._encoder_parameter(name)
        if target is None:
            return
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
        copy_checkpoint_tensor(params[target].data, tensor, hf_name)
        loaded.add(target)
