"""kvfleet's inference runtime: paged KV cache, continuous batching, OpenAI-compatible serving."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin while waiting steal the cores of a shared or oversubscribed machine; on 2 cores
# that made a decode step 2-3x slower. It only takes effect if set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.lora.request import LoRARequest
    from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "LoRARequest", "SamplingParams", "StructuredOutputsParams"]

_EXPORTS = {
    "LLM": "kvfleet.runtime.engine.llm",
    "EngineConfig": "kvfleet.runtime.config",
    "LoRARequest": "kvfleet.runtime.lora.request",
    "SamplingParams": "kvfleet.runtime.sampling_params",
    "StructuredOutputsParams": "kvfleet.runtime.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy so that importing a light submodule (the CLI, the config) does not load torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
