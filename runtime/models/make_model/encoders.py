"""What the multimodal models' random encoders share: pre-norm encoder layers (CLIP's and Whisper's), the
Whisper-style audio encoder and its features, and CLIP's pixel steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUDIO_MARKERS = ("<|audio_bos|>", "<|audio_eos|>")  # a clip's begin and end

# What LLaVA's and Qwen2.5-Omni's image processors do after resizing: scale to [0, 1], then OpenAI CLIP's
# normalisation.
CLIP_PIXEL_STEPS = {
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


@dataclass(frozen=True)
class AudioPreset:
    d_model: int
    encoder_ffn_dim: int
    encoder_layers: int
    encoder_attention_heads: int
    num_mel_bins: int


# The audio encoder of each preset. Every one takes Whisper's 30 s window (3000 mel frames, 750 audio tokens
# at most; a second of audio gives 25); Qwen2-Audio's own is 1280 wide, 32 layers deep, on 128 mel bins.
AUDIO_PRESETS: dict[str, AudioPreset] = {
    "tiny": AudioPreset(32, 64, 2, 2, 80),
    "small": AudioPreset(256, 1024, 4, 4, 128),
    "small-draft": AudioPreset(32, 64, 2, 2, 80),
}

_AUDIO_SAMPLING_RATE = 16000
_AUDIO_HOP_LENGTH = 160  # samples per mel frame
_AUDIO_WINDOW_S = 30
_AUDIO_MAX_SOURCE_POSITIONS = _AUDIO_WINDOW_S * _AUDIO_SAMPLING_RATE // _AUDIO_HOP_LENGTH // 2


def encoder_layer_weights(
    prefix: str,
    width: int,
    inner: int,
    normal: Any,
    *,
    norms: tuple[str, str],
    mlp: str,
    key_bias: bool = True,
) -> dict[str, Any]:
    """A random pre-norm encoder layer (CLIP's or Whisper's): its two norms' names, and the prefix of its
    MLP's fc1 and fc2."""
    import torch

    tensors = {}
    for norm in norms:
        tensors[f"{prefix}.{norm}.weight"] = torch.ones(width)
        tensors[f"{prefix}.{norm}.bias"] = torch.zeros(width)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        tensors[f"{prefix}.self_attn.{name}.weight"] = normal(width, width, std=width**-0.5)
        if key_bias or name != "k_proj":
            tensors[f"{prefix}.self_attn.{name}.bias"] = normal(width, std=0.02)
    tensors[f"{prefix}.{mlp}fc1.weight"] = normal(inner, width, std=width**-0.5)
    tensors[f"{prefix}.{mlp}fc1.bias"] = normal(inner, std=0.02)
    tensors[f"{prefix}.{mlp}fc2.weight"] = normal(width, inner, std=inner**-0.5)
    tensors[f"{prefix}.{mlp}fc2.bias"] = normal(width, std=0.02)
    return tensors


def whisper_weights(tower: str, audio: dict[str, Any], normal: Any) -> dict[str, Any]:
    """A random Whisper-style audio encoder's convolutions and layers (Whisper's names; its keys have no
    bias)."""
    width, mel_bins = audio["d_model"], audio["num_mel_bins"]
    tensors = {
        f"{tower}.conv1.weight": normal(width, mel_bins, 3, std=(3 * mel_bins) ** -0.5),
        f"{tower}.conv1.bias": normal(width, std=0.02),
        f"{tower}.conv2.weight": normal(width, width, 3, std=(3 * width) ** -0.5),
        f"{tower}.conv2.bias": normal(width, std=0.02),
    }
    for i in range(audio["encoder_layers"]):
        tensors |= encoder_layer_weights(
            f"{tower}.layers.{i}",
            width,
            audio["encoder_ffn_dim"],
            normal,
            norms=("self_attn_layer_norm", "final_layer_norm"),
            mlp="",
            key_bias=False,
        )
    return tensors


def language_model_tensors(text_tensors: dict[str, Any]) -> dict[str, Any]:
    """A text model's tensors under a multimodal model's names (Transformers 5's layout)."""
    return {
        (
            "lm_head.weight"
            if name == "lm_head.weight"
            else "model.language_model." + name.removeprefix("model.")
        ): tensor
        for name, tensor in text_tensors.items()
    }


def whisper_audio_config(audio: AudioPreset) -> dict[str, Any]:
    """A Whisper-style audio encoder's settings (Qwen2-Audio's and Qwen2.5-Omni's)."""
    return {
        "d_model": audio.d_model,
        "encoder_ffn_dim": audio.encoder_ffn_dim,
        "encoder_layers": audio.encoder_layers,
        "encoder_attention_heads": audio.encoder_attention_heads,
        "num_mel_bins": audio.num_mel_bins,
        "max_source_positions": _AUDIO_MAX_SOURCE_POSITIONS,
        "activation_function": "gelu",
        "scale_embedding": False,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
    }


def whisper_feature_extractor(audio: dict[str, Any]) -> dict[str, Any]:
    """WhisperFeatureExtractor's settings for the encoder's 30 s window."""
    num_frames = 2 * audio["max_source_positions"]
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": audio["num_mel_bins"],
        "sampling_rate": _AUDIO_SAMPLING_RATE,
        "hop_length": _AUDIO_HOP_LENGTH,
        "chunk_length": _AUDIO_WINDOW_S,
        "n_fft": 400,
        "n_samples": num_frames * _AUDIO_HOP_LENGTH,
        "nb_max_frames": num_frames,
        "padding_side": "right",
        "padding_value": 0.0,
        "dither": 0.0,
        "return_attention_mask": True,
    }


def nested_text_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """A text model's config as a multimodal config's `text_config`: without the keys the outer one holds."""
    return {key: value for key, value in text_config.items() if key not in ("architectures", "dtype")}
