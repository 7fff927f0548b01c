"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a Llama-family
language model over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.models.encoders import ConditionalGeneration, EncoderLayer, activation
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.multimodal.image_processor import vision_settings
from torch import nn


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
            EncoderLayer(
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


class LlavaForConditionalGeneration(ConditionalGeneration):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__(config, attention, max_position)
        multimodal = config.multimodal
        assert multimodal is not None
        settings = vision_settings(multimodal)
        vision = multimodal["vision_config"]
        self.keep_class_token = settings.keep_class_token
        self.vision_tower = CLIPVisionTower(vision, settings.feature_layer)
        projector_bias = bool(multimodal.get("multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(int(vision["hidden_size"]), config.hidden_size, bias=projector_bias)
        self.linear_2 = nn.Linear(config.hidden_size, config.hidden_size, bias=projector_bias)
        self.projector_activation = activation(multimodal.get("projector_hidden_act", "gelu"))

    def embed_multimodal(
        self, modality: str, data: torch.Tensor, unpadded_lengths: torch.Tensor
    ) -> torch.Tensor:
        """Images [images, 3, H, W] -> [images, tokens per image, hidden]: what replaces their
        placeholders."""
        if modality != "image":
            raise ValueError(f"LLaVA takes images, not {modality}")
        features = self.vision_tower(data.to(self.linear_1.weight.dtype))
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.linear_2(self.projector_activation(self.linear_1(features)))

    def _encoder_parameter(self, name: str) -> str | None:
        """Vision layers past the one LLaVA reads, and CLIP's final norm, are not used."""
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
            name = name.replace(".embeddings.", ".").replace(".encoder.layers.", ".layers.")
            if name.startswith("vision_tower.post_layernorm.") or name.endswith("position_ids"):
                return None  # LLaVA reads a layer's output before CLIP's final norm
            if name.startswith("vision_tower.layers.") and int(name.split(".")[2]) >= len(
                self.vision_tower.layers
            ):
                return None  # past the feature layer
        return name.removeprefix("multi_modal_projector.")
