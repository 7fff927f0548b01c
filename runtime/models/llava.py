"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a Llama-family
language model over the paged KV cache.

Images are encoded apart from the decoder (`embed_images`, batched over images); the model runner puts each
image's embeddings in place of its placeholder tokens and hands the decoder `inputs_embeds`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.models.layers import copy_checkpoint_tensor
from kvfleet.runtime.models.llama import LlamaForCausalLM
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.multimodal.image_processor import vision_settings
from torch import nn
from torch.nn import functional


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": _quick_gelu, "gelu": functional.gelu}


def _activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class CLIPEncoderLayer(nn.Module):
    def __init__(self, width: int, inner: int, num_heads: int, eps: float, activation: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = nn.ModuleDict(
            {name: nn.Linear(width, width) for name in ("q_proj", "k_proj", "v_proj")}
        )
        self.self_attn["out_proj"] = nn.Linear(width, width)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(width, inner), "fc2": nn.Linear(inner, width)})
        self.activation = _activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [images, tokens, width]
        images, tokens, width = x.shape
        normed = self.layer_norm1(x)
        heads = [
            self.self_attn[name](normed).view(images, tokens, self.num_heads, -1).transpose(1, 2)
            for name in ("q_proj", "k_proj", "v_proj")
        ]
        attended = functional.scaled_dot_product_attention(*heads)  # every patch sees every patch
        x = x + self.self_attn["out_proj"](attended.transpose(1, 2).reshape(images, tokens, width))
        return x + self.mlp["fc2"](self.activation(self.mlp["fc1"](self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to the layer whose output LLaVA reads (later layers never run)."""

    def __init__(self, vision: dict[str, Any], num_layers_run: int) -> None:
        super().__init__()
        width = int(vision["hidden_size"])
        self.patch_size = int(vision["patch_size"])
        num_patches = (int(vision["image_size"]) // self.patch_size) ** 2
        eps = float(vision.get("layer_norm_eps", 1e-5))
        self.class_embedding = nn.Parameter(torch.zeros(width))
        self.patch_embedding = nn.Conv2d(
            int(vision.get("num_channels", 3)), width, self.patch_size, stride=self.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(num_patches + 1, width)
        self.pre_layrnorm = nn.LayerNorm(width, eps=eps)
        self.layers = nn.ModuleList(
            CLIPEncoderLayer(
                width,
                int(vision["intermediate_size"]),
                int(vision["num_attention_heads"]),
                eps,
                vision.get("hidden_act", "quick_gelu"),
            )
            for _ in range(num_layers_run)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [images, 3, H, W] -> [images, T, width]
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__()
        if config.multimodal is None:
            raise ValueError("LlavaForConditionalGeneration needs config.json's vision_config")
        self.config = config
        settings = vision_settings(config.multimodal)
        vision = config.multimodal["vision_config"]
        self.num_vision_layers = int(vision["num_hidden_layers"])
        self.keep_class_token = settings.keep_class_token
        self.image_token_id = settings.image_token_id
        self.vision_tower = CLIPVisionTower(vision, settings.feature_layer)
        projector_bias = bool(config.multimodal.get("multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(int(vision["hidden_size"]), config.hidden_size, bias=projector_bias)
        self.linear_2 = nn.Linear(config.hidden_size, config.hidden_size, bias=projector_bias)
        self.projector_activation = _activation(config.multimodal.get("projector_hidden_act", "gelu"))
        self.language_model = LlamaForCausalLM(config, attention, max_position)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, tokens per image, hidden]: what replaces their placeholders."""
        features = self.vision_tower(pixel_values.to(self.linear_1.weight.dtype))
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.linear_2(self.projector_activation(self.linear_1(features)))

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
        """Checkpoints in Transformers 5's layout (`model.language_model.`, `model.vision_tower.`, ...) or the
        older one (`language_model.model.`, `vision_tower.`, ...). The vision layers past the one LLaVA reads
        are skipped. Raises ValueError naming the tensor for unknown names, wrong shapes or missing ones."""
        params = dict(self.named_parameters())
        vision_loaded: set[str] = set()

        def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
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
                    self._load_vision_tensor(hf_name, name, tensor, params, vision_loaded)

        self.language_model.load_weights(language_weights())
        missing = sorted(
            name for name in params if not name.startswith("language_model.") and name not in vision_loaded
        )
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} vision tensors, e.g. {', '.join(missing[:4])}"
            )

    def _load_vision_tensor(
        self,
        hf_name: str,
        name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
    ) -> None:
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
            name = name.replace(".embeddings.", ".").replace(".encoder.layers.", ".layers.")
            if name.startswith("vision_tower.post_layernorm.") or name.endswith("position_ids"):
                return  # LLaVA reads a layer's output before CLIP's final norm
            if name.startswith("vision_tower.layers.") and int(name.split(".")[2]) >= len(
                self.vision_tower.layers
            ):
                return  # past the feature layer
        elif name.startswith("multi_modal_projector."):
            name = name.removeprefix("multi_modal_projector.")
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
        target = params[name].data
        copy_checkpoint_tensor(target, tensor, hf_name)
        loaded.add(name)
