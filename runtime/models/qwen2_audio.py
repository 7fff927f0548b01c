"""Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): a Whisper-style audio encoder (two convolutions, the
second of stride 2, then transformer layers, average pooling by 2 and a final norm), a linear projector, and a
Qwen2 language model over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.models.encoders import ConditionalGeneration, EncoderLayer
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.multimodal.audio import audio_settings
from torch import nn
from torch.nn import functional

# Whisper's names of an encoder layer's parts -> EncoderLayer's (CLIP's).
WHISPER_LAYER_NAMES = {
    "self_attn_layer_norm.": "layer_norm1.",
    "final_layer_norm.": "layer_norm2.",
    "fc1.": "mlp.fc1.",
    "fc2.": "mlp.fc2.",
}


class WhisperStyleEncoder(nn.Module):
    """Whisper's two convolutions (the second of stride 2) and its encoder layers, under Whisper's names
    (`conv1`, `conv2`, `layers.`), as Qwen's audio encoders build on them."""

    def __init__(self, audio: dict[str, Any]) -> None:
        super().__init__()
        width = int(audio["d_model"])
        num_mel_bins = int(audio.get("num_mel_bins", 128))
        if audio.get("scale_embedding", False):
            raise ValueError("audio_config.scale_embedding is not supported")
        self.conv1 = nn.Conv1d(num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(
            EncoderLayer(
                width,
                int(audio["encoder_ffn_dim"]),
                int(audio["encoder_attention_heads"]),
                1e-5,
                audio.get("activation_function", "gelu"),
                key_bias=False,
            )
            for _ in range(int(audio["encoder_layers"]))
        )


class Qwen2AudioEncoder(WhisperStyleEncoder):
    def __init__(self, audio: dict[str, Any]) -> None:
        super().__init__(audio)
        width = int(audio["d_model"])
        self.embed_positions = nn.Embedding(int(audio.get("max_source_positions", 1500)), width)
        self.layer_norm = nn.LayerNorm(width)

    def forward(self, features: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """features: [clips, mel bins, window frames]; num_frames: [clips], each clip's unpadded frames.
        Returns [clips, window frames / 4, width]; a clip's first num_tokens(frames) rows are its own."""
        x = functional.gelu(self.conv1(features))
        x = functional.gelu(self.conv2(x)).transpose(1, 2) + self.embed_positions.weight
        # Positions past a clip's end (after the stride-2 convolution) are never attended to.
        lengths = (num_frames - 1) // 2 + 1
        key_mask = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = functional.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)


class Qwen2AudioForConditionalGeneration(ConditionalGeneration):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__(config, attention, max_position)
        multimodal = config.multimodal
        assert multimodal is not None
        self.settings = audio_settings(multimodal)
        audio = multimodal["audio_config"]
        self.audio_tower = Qwen2AudioEncoder(audio)
        self.linear = nn.Linear(int(audio["d_model"]), config.hidden_size)

    def embed_multimodal(
        self, modality: str, data: torch.Tensor, unpadded_lengths: torch.Tensor
    ) -> list[torch.Tensor]:
        """Clips' log-mel features [clips, mel bins, frames] and unpadded frames -> each clip's embeddings,
        [its tokens, hidden]: what replaces its placeholders."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio takes audio, not {modality}")
        embeddings = self.linear(self.audio_tower(data.to(self.linear.weight.dtype), unpadded_lengths))
        # Copies: a view would keep the whole window's embeddings alive in the encoder cache.
        return [
            clip[: self.settings.num_tokens(int(frames))].clone()
            for clip, frames in zip(embeddings, unpadded_lengths.tolist(), strict=True)
        ]

    def _encoder_parameter(self, name: str) -> str:
        if name.startswith("audio_tower.layers."):
            for whisper, ours in WHISPER_LAYER_NAMES.items():
                name = name.replace(f".{whisper}", f".{ours}")
            return name
        return name.removeprefix("multi_modal_projector.")
