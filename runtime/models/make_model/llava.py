"""LLaVA: a CLIP vision tower and a projector in front of a Llama language model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.make_model.encoders import (
    CLIP_PIXEL_STEPS,
    encoder_layer_weights,
    language_model_tensors,
    nested_text_config,
)
from kvfleet.runtime.models.make_model.files import write_json
from kvfleet.runtime.models.make_model.tokenizer import LLAMA3_TEMPLATE, LLAMA_STYLE

ARCHITECTURE = ("LlavaForConditionalGeneration", "llava")
TEXT_ARCH = "llama"

# LLaVA's template renders an image content part as the image token, which the processor (or the engine)
# then repeats once per image embedding.
_LLAVA_TEMPLATE = LLAMA3_TEMPLATE.replace(
    "{% else %}{{ message['content'] | trim }}{% endif %}",
    "{% elif message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}",
)
IMAGE_TOKEN = "<image>"
STYLE = replace(
    LLAMA_STYLE, special_tokens=(*LLAMA_STYLE.special_tokens, IMAGE_TOKEN), chat_template=_LLAVA_TEMPLATE
)


@dataclass(frozen=True)
class VisionPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int


# The CLIP tower of each preset: (image_size / patch_size)^2 image tokens, 25 for tiny and 256 for small
# (LLaVA 1.5's 336 / 14 gives 576).
VISION_PRESETS: dict[str, VisionPreset] = {
    "tiny": VisionPreset(32, 64, 2, 2, 30, 6),
    "small": VisionPreset(256, 1024, 4, 4, 224, 14),
    "small-draft": VisionPreset(32, 64, 2, 2, 30, 6),
}


def _config(text_config: dict[str, Any], vision: VisionPreset, image_token_id: int) -> dict[str, Any]:
    text = nested_text_config(text_config)
    return {
        "architectures": [ARCHITECTURE[0]],
        "model_type": ARCHITECTURE[1],
        "image_token_index": image_token_id,
        "image_seq_length": (vision.image_size // vision.patch_size) ** 2,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_hidden_layers,
            "num_attention_heads": vision.num_attention_heads,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "projection_dim": text_config["hidden_size"],
        },
        "dtype": text_config["dtype"],
    }


def _weights(text_tensors: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The language model's tensors under LLaVA's names, plus a random CLIP tower and projector scaled so
    that image embeddings have the size of token embeddings (and the constant dimension 0 that
    text.random_weights gives every token)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    vision = config["vision_config"]
    width = vision["hidden_size"]
    inner = vision["intermediate_size"]
    text_hidden = config["text_config"]["hidden_size"]
    num_patches = (vision["image_size"] // vision["patch_size"]) ** 2

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = language_model_tensors(text_tensors)
    tower = "model.vision_tower.vision_model"
    patch_inputs = 3 * vision["patch_size"] ** 2
    tensors[f"{tower}.embeddings.class_embedding"] = normal(width, std=1.0)
    tensors[f"{tower}.embeddings.patch_embedding.weight"] = normal(
        width, 3, vision["patch_size"], vision["patch_size"], std=patch_inputs**-0.5
    )
    tensors[f"{tower}.embeddings.position_embedding.weight"] = normal(num_patches + 1, width, std=0.5)
    for norm in ("pre_layrnorm", "post_layernorm"):
        tensors[f"{tower}.{norm}.weight"] = torch.ones(width)
        tensors[f"{tower}.{norm}.bias"] = torch.zeros(width)
    for i in range(vision["num_hidden_layers"]):
        tensors |= encoder_layer_weights(
            f"{tower}.encoder.layers.{i}",
            width,
            inner,
            normal,
            norms=("layer_norm1", "layer_norm2"),
            mlp="mlp.",
        )
    projector = "model.multi_modal_projector"
    tensors[f"{projector}.linear_1.weight"] = normal(text_hidden, width, std=width**-0.5)
    tensors[f"{projector}.linear_1.bias"] = normal(text_hidden, std=0.02)
    tensors[f"{projector}.linear_2.weight"] = normal(text_hidden, text_hidden, std=2 * text_hidden**-0.5)
    tensors[f"{projector}.linear_2.bias"] = normal(text_hidden, std=0.02)
    tensors[f"{projector}.linear_2.weight"][0] = 0.0
    tensors[f"{projector}.linear_2.bias"][0] = 1.0
    return tensors


def _write_processor(out: Path, config: dict[str, Any]) -> None:
    """preprocessor_config.json and processor_config.json, as LLaVA 1.5 ships them (CLIP's resize to the
    shortest edge, centre crop and normalisation), for Transformers' LlavaProcessor and the engine alike."""
    vision = config["vision_config"]
    size = vision["image_size"]
    write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            **CLIP_PIXEL_STEPS,
        },
    )
    write_json(
        out / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": vision["patch_size"],
            "vision_feature_select_strategy": config["vision_feature_select_strategy"],
            "num_additional_image_tokens": 1,
        },
    )
    (out / "chat_template.jinja").write_text(_LLAVA_TEMPLATE, encoding="utf-8")


def build(
    out: Path,
    text_config: dict[str, Any],
    text_tensors: dict[str, Any],
    special_ids: dict[str, int],
    preset: str,
    seed: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model's config and tensors around its language model's; writes the processor's files."""
    config = _config(text_config, VISION_PRESETS[preset], special_ids[IMAGE_TOKEN])
    _write_processor(out, config)
    return config, _weights(text_tensors, config, seed)
