"""kvfleet's inference runtime: paged KV cache, continuous batching, OpenAI-compatible serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

_EXPORTS = {
    "LLM": "kvfleet.runtime.engine.llm",
    "EngineConfig": "kvfleet.runtime.config",
    "SamplingParams": "kvfleet.runtime.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy so that importing a light submodule (the CLI, the config) does not load torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
