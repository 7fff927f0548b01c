"""Qwen2-Audio: a Whisper-style audio encoder and a projector in front of a Qwen2 language model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.make_model.encoders import (
    AUDIO_MARKERS,
    AUDIO_PRESETS,
    AudioPreset,
    language_model_tensors,
    nested_text_config,
    whisper_audio_config,
    whisper_feature_extractor,
    whisper_weights,
)
from kvfleet.runtime.models.make_model.files import write_json
from kvfleet.runtime.models.make_model.tokenizer import CHATML_TEMPLATE, QWEN_STYLE

ARCHITECTURE = ("Qwen2AudioForConditionalGeneration", "qwen2_audio")
TEXT_ARCH = "qwen2"

# Qwen2-Audio's template renders an audio content part as the audio token between its begin and end
# markers; the processor (or the engine) then repeats the audio token once per audio embedding.
AUDIO_TOKEN = "<|AUDIO|>"
_QWEN2_AUDIO_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'audio' %}{{ '"
    + AUDIO_MARKERS[0]
    + AUDIO_TOKEN
    + AUDIO_MARKERS[1]
    + "' }}{% endif %}"
    "{% endfor %}{% endif %}",
)

STYLE = replace(
    QWEN_STYLE,
    special_tokens=(*QWEN_STYLE.special_tokens, AUDIO_TOKEN, *AUDIO_MARKERS),
    chat_template=_QWEN2_AUDIO_TEMPLATE,
)


def _config(text_config: dict[str, Any], audio: AudioPreset, audio_token_id: int) -> dict[str, Any]:
    text = nested_text_config(text_config)
    return {
        "architectures": [ARCHITECTURE[0]],
        "model_type": ARCHITECTURE[1],
        "audio_token_index": audio_token_id,
        "tie_word_embeddings": False,
        "text_config": text,
        "audio_config": {**whisper_audio_config(audio), "model_type": "qwen2_audio_encoder"},
        "dtype": text_config["dtype"],
    }


def _weights(text_tensors: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The language model's tensors under Qwen2-Audio's names, plus a random audio encoder and projector
    scaled so that audio embeddings have the size of token embeddings (and the constant dimension 0 that
    text.random_weights gives every token)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    audio = config["audio_config"]
    width = audio["d_model"]
    text_hidden = config["text_config"]["hidden_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = language_model_tensors(text_tensors)
    tower = "model.audio_tower"
    tensors |= whisper_weights(tower, audio, normal)
    tensors[f"{tower}.embed_positions.weight"] = normal(audio["max_source_positions"], width, std=0.5)
    tensors[f"{tower}.layer_norm.weight"] = torch.ones(width)
    tensors[f"{tower}.layer_norm.bias"] = torch.zeros(width)
    projector = "model.multi_modal_projector.linear"
    tensors[f"{projector}.weight"] = normal(text_hidden, width, std=width**-0.5)
    tensors[f"{projector}.bias"] = normal(text_hidden, std=0.02)
    tensors[f"{projector}.weight"][0] = 0.0
    tensors[f"{projector}.bias"][0] = 1.0
    return tensors


def _write_processor(out: Path, config: dict[str, Any]) -> None:
    """preprocessor_config.json (Whisper's log-mel features, as Qwen2-Audio ships them) and
    processor_config.json, for Transformers' Qwen2AudioProcessor and the engine alike."""
    write_json(
        out / "preprocessor_config.json",
        {**whisper_feature_extractor(config["audio_config"]), "processor_class": "Qwen2AudioProcessor"},
    )
    write_json(
        out / "processor_config.json",
        {
            "processor_class": "Qwen2AudioProcessor",
            "audio_token": AUDIO_TOKEN,
            "audio_bos_token": AUDIO_MARKERS[0],
            "audio_eos_token": AUDIO_MARKERS[1],
        },
    )
    (out / "chat_template.jinja").write_text(_QWEN2_AUDIO_TEMPLATE, encoding="utf-8")


def build(
    out: Path,
    text_config: dict[str, Any],
    text_tensors: dict[str, Any],
    special_ids: dict[str, int],
    preset: str,
    seed: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model's config and tensors around its language model's; writes the processor's files."""
    config = _config(text_config, AUDIO_PRESETS[preset], special_ids[AUDIO_TOKEN])
    _write_processor(out, config)
    return config, _weights(text_tensors, config, seed)
