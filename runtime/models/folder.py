"""Whether a path is a model folder the engine can load, told in one line before anything heavy starts.

Reads only config.json (no torch, no Transformers), so that a wrong path fails in a blink rather than after
the server has opened its port and the engine has spent its start-up loading libraries.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfleet.runtime.hf_config import config_source, read_hf_config
from kvfleet.runtime.models.registry import REFUSED_ARCHITECTURES, ModelRegistry


def check_model_folder(model: str, hf_overrides: Mapping[str, Any] | None = None) -> None:
    """Raises ValueError, with a one-line reason, when `model` is not a folder holding a config.json whose
    architecture (after vLLM's hf_overrides) kvfleet serves."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"the model folder {model} does not exist")
    if not path.is_dir():
        raise ValueError(f"{model} is a file, not a model folder")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model} holds no config.json: a model folder needs a Hugging Face config.json")
    architectures = read_hf_config(path, hf_overrides).get("architectures")
    source = config_source(path, hf_overrides)
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise ValueError(f"{source}: 'architectures' must name exactly one class, got {architectures!r}")
    (architecture,) = architectures
    if architecture in REFUSED_ARCHITECTURES:
        raise ValueError(f"{source}: {REFUSED_ARCHITECTURES[architecture]}")
    supported = ModelRegistry().supported_architectures
    if architecture not in supported:
        raise ValueError(
            f"{source}: model architecture {architecture!r} is not supported; supported: "
            + ", ".join(supported)
        )
