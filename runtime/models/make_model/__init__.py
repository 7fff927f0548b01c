"""Write a small, randomly initialised Hugging Face model folder that every loader accepts.

The folder holds config.json (the real architecture name), model.safetensors (seeded random weights under
the checkpoint's usual tensor names), and a byte-level BPE tokenizer trained on the English prose shipped in
`data/corpus.txt`, with a chat template in the style of the architecture's family.

With train_steps, the random weights are then trained on that same corpus (next-token prediction, on the
CPU, a few minutes for the small preset): models made so, whatever their size or seed, continue a text from
the corpus alike, which gives speculative decoding's draft models something real to agree on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.make_model import llava, omni, qwen2_audio
from kvfleet.runtime.models.make_model.files import save_weights, write_json
from kvfleet.runtime.models.make_model.quantize import SCHEMES, quantize_folder
from kvfleet.runtime.models.make_model.text import PRESETS, TEXT_ARCHITECTURES, random_weights, text_config
from kvfleet.runtime.models.make_model.tokenizer import (
    LLAMA_STYLE,
    QWEN3_STYLE,
    QWEN_STYLE,
    corpus_text,
    generation_config,
    tokenizer_config,
    train_tokenizer,
)
from kvfleet.runtime.models.make_model.training import load_teacher, train

__all__ = ["ARCHITECTURES", "DTYPES", "PRESETS", "corpus_text", "make_model"]

# Each multimodal architecture's module: its encoders and processor around a text architecture's model.
_MULTIMODAL = {"llava": llava, "qwen2-audio": qwen2_audio, "qwen2.5-omni": omni}
ARCHITECTURES: dict[str, tuple[str, str]] = {
    **TEXT_ARCHITECTURES,
    **{name: module.ARCHITECTURE for name, module in _MULTIMODAL.items()},
}
DTYPES = ("float32", "bfloat16", "float16")
_TEXT_STYLES = {"qwen2": QWEN_STYLE, "qwen3": QWEN3_STYLE, "qwen3-moe": QWEN3_STYLE}


def make_model(
    arch: str,
    preset: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int | None = None,
    rope_parameters: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
    train_steps: int = 0,
    teacher: str | Path | None = None,
    quantize: str | None = None,
    quantize_lm_head: bool = False,
) -> Path:
    """Write the folder; returns its path. Raises ValueError for unknown choices or a non-empty folder.

    max_position_embeddings and rope_parameters (Transformers' `rope_parameters`, rope_theta included)
    replace the preset's and the architecture's, e.g. to make a model with another RoPE scaling.
    sliding_window gives Mistral, Mixtral and Qwen3-MoE a window on every layer, and Qwen2/3 one on the
    layers from max_window_layers on (Llama has none). train_steps then trains the weights on the
    tokenizer's corpus: to predict its next tokens, or, given a teacher model folder of the same tokenizer,
    to predict the teacher's next-token distributions (knowledge distillation, as draft models are made).
    quantize names a weight-only scheme (`quantize.SCHEMES`) the projections are then stored in, and
    quantize_lm_head the LM head too."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if quantize is not None and (quantize not in SCHEMES or arch in _MULTIMODAL):
        raise ValueError(f"quantize takes {', '.join(SCHEMES)} on text models, not {quantize!r} on {arch}")
    if quantize_lm_head and quantize is None:
        raise ValueError("quantize_lm_head quantizes the LM head with the projections: give quantize too")
    if train_steps < 0:
        raise ValueError(f"train_steps must not be negative, got {train_steps}")
    if teacher is not None and not train_steps:
        raise ValueError("a teacher is learnt from in training: give train_steps too")
    multimodal = _MULTIMODAL.get(arch)
    if multimodal is not None and train_steps:
        raise ValueError(f"train_steps trains text-only models; {arch}'s are not trained")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    if multimodal is not None:
        style, text_arch = multimodal.STYLE, multimodal.TEXT_ARCH
    else:
        style, text_arch = _TEXT_STYLES.get(arch, LLAMA_STYLE), arch
    spec = PRESETS[preset]
    if max_position_embeddings is not None:
        if max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be positive, got {max_position_embeddings}")
        spec = replace(spec, max_position_embeddings=max_position_embeddings)
    tokenizer = train_tokenizer(style, spec.vocab_size, add_bos=style.bos_token is not None)
    tokenizer.save(str(out / "tokenizer.json"))
    special_ids = {token: tokenizer.token_to_id(token) for token in style.special_tokens}
    config = text_config(text_arch, spec, style, special_ids, dtype)
    if rope_parameters is not None:
        config["rope_parameters"] = rope_parameters
    if sliding_window is not None:
        _slide(config, arch, text_arch, sliding_window, max_window_layers)
    write_json(out / "tokenizer_config.json", tokenizer_config(style, spec.max_position_embeddings))
    write_json(out / "generation_config.json", generation_config(style, special_ids))
    tensors = random_weights(config, seed, num_used_ids=tokenizer.get_vocab_size())
    if multimodal is not None:
        config, tensors = multimodal.build(out, config, tensors, special_ids, preset, seed)
    write_json(out / "config.json", config)
    save_weights(out / "model.safetensors", tensors, config["dtype"])
    if train_steps:
        teacher_model = None if teacher is None else load_teacher(Path(teacher), out)
        train(out, tokenizer, train_steps, seed, teacher_model)
    if quantize is not None:
        quantize_folder(out, quantize, lm_head=quantize_lm_head)
    return out


def _slide(config: dict[str, Any], arch: str, text_arch: str, window: int, max_window_layers: int) -> None:
    if text_arch == "llama" or window < 1:
        raise ValueError(f"sliding_window needs a positive window on mistral or qwen, got {arch} {window}")
    config["sliding_window"] = window
    if text_arch == "qwen3-moe":
        config["use_sliding_window"] = True  # on every layer: Qwen3-MoE has no max_window_layers
    elif text_arch.startswith("qwen"):
        config.update(use_sliding_window=True, max_window_layers=max_window_layers)
