"""A model folder's config.json as the engine reads it: with vLLM's `hf_overrides` applied, in one place, so
that every reader (the folder check, the quantization check, the model, the multimodal processors) sees the
same config.

Reads JSON only (no torch, no Transformers): the folder check runs it before anything heavy starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def read_hf_config(model_dir: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json of `model_dir`, with `overrides` applied. Raises FileNotFoundError where there is none and
    ValueError, naming the file, where it is not a JSON object."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a model folder needs a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return with_overrides(raw, overrides or {})


def config_source(model_dir: str | Path, overrides: Mapping[str, Any] | None) -> str:
    """How an error names the config it found wrong: its file, and whether overrides changed it."""
    path = str(Path(model_dir) / "config.json")
    return f"{path} with hf_overrides" if overrides else path


def with_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with each key of `overrides` set, as vLLM sets its hf_overrides on a Transformers config: a
    nested model config (a dict with its own model_type, such as a multimodal model's text_config) takes the
    override's keys into it, dicts within it merged key by key; any other value is replaced whole, a dict such
    as rope_scaling included."""
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        is_nested_config = isinstance(current, dict) and "model_type" in current
        merged[key] = _merged(current, value) if is_nested_config and isinstance(value, dict) else value
    return merged


def _merged(base: dict[str, Any], updates: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in updates.items():
        current = merged.get(key)
        both_dicts = isinstance(current, dict) and isinstance(value, dict)
        merged[key] = _merged(current, value) if both_dicts else value
    return merged
