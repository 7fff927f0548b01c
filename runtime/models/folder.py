"""Whether a path is a model folder the engine can load, told in one line before anything heavy starts.

Reads only config.json (no torch, no Transformers), so that a wrong path fails in a blink rather than after
the server has opened its port and the engine has spent its start-up loading libraries.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.runtime.models.registry import REFUSED_ARCHITECTURES, ModelRegistry


def check_model_folder(model: str) -> None:
    """Raises ValueError, with a one-line reason, when `model` is not a folder holding a config.json whose
    architecture kvfleet serves."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"the model folder {model} does not exist")
    if not path.is_dir():
        raise ValueError(f"{model} is a file, not a model folder")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model} holds no config.json: a model folder needs a Hugging Face config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise ValueError(f"{config_path}: 'architectures' must name exactly one class, got {architectures!r}")
    (architecture,) = architectures
    if architecture in REFUSED_ARCHITECTURES:
        raise ValueError(f"{config_path}: {REFUSED_ARCHITECTURES[architecture]}")
    supported = ModelRegistry().supported_architectures
    if architecture not in supported:
        raise ValueError(
            f"{config_path}: model architecture {architecture!r} is not supported; supported: "
            + ", ".join(supported)
        )
