"""Qwen2.5-Omni's thinker: a vision transformer and an audio encoder in front of a Qwen2 language model
with M-RoPE."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.make_model.encoders import (
    AUDIO_MARKERS,
    AUDIO_PRESETS,
    CLIP_PIXEL_STEPS,
    AudioPreset,
    nested_text_config,
    whisper_audio_config,
    whisper_feature_extractor,
    whisper_weights,
)
from kvfleet.runtime.models.make_model.files import write_json
from kvfleet.runtime.models.make_model.tokenizer import CHATML_TEMPLATE, QWEN_STYLE

ARCHITECTURE = ("Qwen2_5OmniThinkerForConditionalGeneration", "qwen2_5_omni_thinker")
TEXT_ARCH = "qwen2"

# Qwen2.5-Omni's renders an image part as the image token between the vision markers, an audio part as
# Qwen2-Audio's does (with its own token names).
OMNI_IMAGE_TOKEN, OMNI_AUDIO_TOKEN, OMNI_VIDEO_TOKEN = "<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>"
_VISION_MARKERS = ("<|vision_bos|>", "<|vision_eos|>")
_OMNI_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '"
    + _VISION_MARKERS[0]
    + OMNI_IMAGE_TOKEN
    + _VISION_MARKERS[1]
    + "' }}"
    "{% elif part['type'] == 'audio' %}{{ '"
    + AUDIO_MARKERS[0]
    + OMNI_AUDIO_TOKEN
    + AUDIO_MARKERS[1]
    + "' }}{% endif %}"
    "{% endfor %}{% endif %}",
)
STYLE = replace(
    QWEN_STYLE,
    special_tokens=(
        *QWEN_STYLE.special_tokens,
        OMNI_IMAGE_TOKEN,
        OMNI_AUDIO_TOKEN,
        OMNI_VIDEO_TOKEN,
        *_VISION_MARKERS,
        *AUDIO_MARKERS,
    ),
    chat_template=_OMNI_TEMPLATE,
    named_tokens=(
        ("image_token", OMNI_IMAGE_TOKEN),
        ("audio_token", OMNI_AUDIO_TOKEN),
        ("video_token", OMNI_VIDEO_TOKEN),
        ("vision_bos_token", _VISION_MARKERS[0]),
        ("vision_eos_token", _VISION_MARKERS[1]),
        ("audio_bos_token", AUDIO_MARKERS[0]),
        ("audio_eos_token", AUDIO_MARKERS[1]),
    ),
)


@dataclass(frozen=True)
class OmniVisionPreset:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    # Blocks that attend over the whole image; the others attend within windows of window_size pixels.
    fullatt_block_indexes: tuple[int, ...]
    window_size: int
    # The largest image, in embeddings (of 28 x 28 pixels each); Qwen2.5-Omni's own takes 16384.
    max_image_tokens: int
    # The text model's heads' frequencies that turn with time, rows and columns.
    mrope_section: tuple[int, int, int]


OMNI_VISION_PRESETS: dict[str, OmniVisionPreset] = {
    "tiny": OmniVisionPreset(32, 64, 2, 2, (1,), 56, 64, (2, 3, 3)),
    "small": OmniVisionPreset(256, 1024, 4, 4, (1, 3), 112, 256, (8, 12, 12)),
    "small-draft": OmniVisionPreset(32, 64, 2, 2, (1,), 56, 64, (2, 6, 6)),
}

_OMNI_PATCH_SIZE = 14
_OMNI_MERGE_SIZE = 2


def _config(
    text_config: dict[str, Any], vision: OmniVisionPreset, audio: AudioPreset, special_ids: dict[str, int]
) -> dict[str, Any]:
    text = nested_text_config(text_config)
    text["model_type"] = "qwen2_5_omni_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(vision.mrope_section)}
    hidden = text_config["hidden_size"]
    return {
        "architectures": [ARCHITECTURE[0]],
        "model_type": ARCHITECTURE[1],
        "image_token_index": special_ids[OMNI_IMAGE_TOKEN],
        "audio_token_index": special_ids[OMNI_AUDIO_TOKEN],
        "video_token_index": special_ids[OMNI_VIDEO_TOKEN],
        "vision_start_token_id": special_ids[_VISION_MARKERS[0]],
        "vision_end_token_id": special_ids[_VISION_MARKERS[1]],
        "audio_start_token_id": special_ids[AUDIO_MARKERS[0]],
        "audio_end_token_id": special_ids[AUDIO_MARKERS[1]],
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "qwen2_5_omni_vision_encoder",
            "depth": vision.depth,
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_heads": vision.num_heads,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": _OMNI_PATCH_SIZE,
            "spatial_merge_size": _OMNI_MERGE_SIZE,
            "temporal_patch_size": 2,
            "window_size": vision.window_size,
            "fullatt_block_indexes": list(vision.fullatt_block_indexes),
            "out_hidden_size": hidden,
        },
        "audio_config": {
            **whisper_audio_config(audio),
            "model_type": "qwen2_5_omni_audio_encoder",
            "n_window": 100,
            "output_dim": hidden,
        },
        "dtype": text_config["dtype"],
    }


def _weights(text_tensors: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The language model's tensors (the thinker keeps a text model's names), plus a random vision
    transformer and audio encoder whose outputs have the size of token embeddings (and the constant
    dimension 0 that text.random_weights gives every token)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = dict(text_tensors)
    hidden = config["text_config"]["hidden_size"]
    vision = config["vision_config"]
    width, inner = vision["hidden_size"], vision["intermediate_size"]
    patch = vision["patch_size"]
    tensors["visual.patch_embed.proj.weight"] = normal(
        width, 3, vision["temporal_patch_size"], patch, patch, std=(3 * 2 * patch * patch) ** -0.5
    )
    for i in range(vision["depth"]):
        prefix = f"visual.blocks.{i}"
        tensors[f"{prefix}.norm1.weight"] = torch.ones(width)
        tensors[f"{prefix}.norm2.weight"] = torch.ones(width)
        for name in ("q", "k", "v", "proj"):
            tensors[f"{prefix}.attn.{name}.weight"] = normal(width, width, std=width**-0.5)
            tensors[f"{prefix}.attn.{name}.bias"] = normal(width, std=0.02)
        for name, rows, columns in (
            ("gate_proj", inner, width),
            ("up_proj", inner, width),
            ("down_proj", width, inner),
        ):
            tensors[f"{prefix}.mlp.{name}.weight"] = normal(rows, columns, std=columns**-0.5)
            tensors[f"{prefix}.mlp.{name}.bias"] = normal(rows, std=0.02)
    merged = width * vision["spatial_merge_size"] ** 2
    tensors["visual.merger.ln_q.weight"] = torch.ones(width)
    tensors["visual.merger.mlp.0.weight"] = normal(merged, merged, std=merged**-0.5)
    tensors["visual.merger.mlp.0.bias"] = normal(merged, std=0.02)
    tensors["visual.merger.mlp.2.weight"] = normal(hidden, merged, std=2 * merged**-0.5)
    tensors["visual.merger.mlp.2.bias"] = normal(hidden, std=0.02)

    audio = config["audio_config"]
    width = audio["d_model"]
    tower = "audio_tower"
    tensors |= whisper_weights(tower, audio, normal)
    tensors[f"{tower}.audio_bos_eos_token.weight"] = normal(2, hidden, std=1.0)
    tensors[f"{tower}.ln_post.weight"] = torch.ones(width)
    tensors[f"{tower}.ln_post.bias"] = torch.zeros(width)
    tensors[f"{tower}.proj.weight"] = normal(hidden, width, std=width**-0.5)
    tensors[f"{tower}.proj.bias"] = normal(hidden, std=0.02)
    for projection in ("visual.merger.mlp.2", f"{tower}.proj"):
        tensors[f"{projection}.weight"][0] = 0.0
        tensors[f"{projection}.bias"][0] = 1.0
    return tensors


def _write_processor(out: Path, config: dict[str, Any], preset: str) -> None:
    """preprocessor_config.json (Qwen2-VL's image resizing and Whisper's log-mel features in one file, as
    Qwen2.5-Omni ships them), processor_config.json and the chat template, for Transformers'
    Qwen2_5OmniProcessor and the engine alike. The tokens' names are in tokenizer_config.json."""
    vision = config["vision_config"]
    pixels_per_token = (vision["patch_size"] * vision["spatial_merge_size"]) ** 2
    write_json(
        out / "preprocessor_config.json",
        {
            **whisper_feature_extractor(config["audio_config"]),
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5OmniProcessor",
            "do_resize": True,
            "resample": 3,
            "size": {
                "shortest_edge": 4 * pixels_per_token,
                "longest_edge": OMNI_VISION_PRESETS[preset].max_image_tokens * pixels_per_token,
            },
            **CLIP_PIXEL_STEPS,
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"],
        },
    )
    write_json(out / "processor_config.json", {"processor_class": "Qwen2_5OmniProcessor"})
    (out / "chat_template.jinja").write_text(_OMNI_TEMPLATE, encoding="utf-8")


def build(
    out: Path,
    text_config: dict[str, Any],
    text_tensors: dict[str, Any],
    special_ids: dict[str, int],
    preset: str,
    seed: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model's config and tensors around its language model's; writes the processor's files."""
    config = _config(text_config, OMNI_VISION_PRESETS[preset], AUDIO_PRESETS[preset], special_ids)
    _write_processor(out, config, preset)
    return config, _weights(text_tensors, config, seed)
