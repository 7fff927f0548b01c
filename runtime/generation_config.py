"""What a model's generation_config.json says of generating: the sampling defaults it recommends, as vLLM's
`--generation-config` reads them (the values its creator set apart from Transformers' own defaults, for
requests that leave them unset), and the tokens that end a sequence."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvfleet.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's sampling keys, by the SamplingParams field each one defaults (vLLM's set).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --override-generation-config (generation_config.json's keys and values) as SamplingParams
    fields; raises ValueError naming a key that is not a sampling one, or a value a request could not
    carry."""
    unknown = sorted(set(overrides) - set(_SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not one of {', '.join(_SAMPLING_KEYS)}")
    fields = {_SAMPLING_KEYS[key]: value for key, value in overrides.items()}
    SamplingParams(**fields)  # raises ValueError naming the field
    return fields


def generation_config_folder(generation_config: str, model: str) -> str:
    """The folder whose generation_config.json vLLM's `generation_config` (auto, vllm or FOLDER) reads: the
    model's for auto and for vllm (which takes none of its sampling defaults, but its end tokens), else
    FOLDER."""
    return model if generation_config in ("auto", "vllm") else generation_config


def configured_sampling_defaults(
    generation_config: str, model: str, overrides: dict[str, Any] | None
) -> dict[str, Any]:
    """The SamplingParams fields a request that leaves them unset takes, as vLLM's engine derives them:
    `generation_config`'s (none for vllm), with `overrides` (override_generation_config) over them. Raises
    ValueError as sampling_defaults and sampling_overrides do."""
    fields = sampling_overrides(overrides or {})
    if generation_config == "vllm":
        return fields
    return {**sampling_defaults(generation_config_folder(generation_config, model)), **fields}


def max_tokens_limit(generation_config: str, defaults: dict[str, Any]) -> int | None:
    """The most tokens any request generates, whatever it asks, as vLLM has it: the max_new_tokens of a
    generation_config FOLDER other than the model's (in `defaults`, configured_sampling_defaults'); None
    otherwise."""
    return None if generation_config in ("auto", "vllm") else defaults.get("max_tokens")


def sampling_defaults(folder: str) -> dict[str, Any]:
    """The SamplingParams fields the folder's generation_config.json sets (none without one); raises
    ValueError for a missing folder or values a request could not carry either."""
    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder")
    if not (Path(folder) / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        recommended = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder}/generation_config.json cannot be read: {exc}") from None
    defaults = {
        name: recommended[key] for key, name in _SAMPLING_KEYS.items() if recommended.get(key) is not None
    }
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{folder}/generation_config.json: {exc}") from None
    if defaults:
        logger.info(
            "requests that leave them unset are sampled with the defaults of %s/generation_config.json: %s "
            "(--generation-config vllm turns them off)",
            folder,
            defaults,
        )
    return defaults


def other_end_token_ids(generation_config: str, model: str, eos_token_id: int | None) -> tuple[int, ...]:
    """The tokens besides the tokenizer's end-of-sequence one that generation_config.json says end a sequence
    (Llama 3's end of a tool-calling turn, Qwen's end of text), read where `generation_config` says
    (generation_config_folder): Transformers and vLLM stop at each. None where the file is missing,
    unreadable or names no other."""
    folder = generation_config_folder(generation_config, model)
    path = Path(folder) / "generation_config.json"
    try:
        named = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    token_ids = [named] if isinstance(named, int) else named if isinstance(named, list) else []
    return tuple(
        token_id
        for token_id in dict.fromkeys(token_ids)
        if isinstance(token_id, int) and not isinstance(token_id, bool) and token_id != eos_token_id
    )
