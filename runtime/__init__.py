"""kvfleet's inference runtime: paged KV cache, continuous batching, OpenAI-compatible serving."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# A decode step is dozens of OpenMP regions tens of microseconds apart. A worker that sleeps as soon as a
# region ends is woken for the next, and on 2 cores those wake-ups were most of a small step (offline
# throughput 392 against 594 tokens/s with the spin below). libgomp spins without end by default, which
# steals the cores of anything beside the engine between steps; GOMP_SPINCOUNT bounds the spin to well under
# a millisecond, so workers stay awake through a step's gaps and sleep between steps. The thread policy
# (worker/cpu_threads.py) runs steps on one thread when other processes take the cores, and one thread has
# no workers to spin. An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (PASSIVE: sleep at once). Read
# when torch is first imported, so set here.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

if TYPE_CHECKING:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.lora.request import LoRARequest
    from kvfleet.runtime.pooling_params import PoolingParams
    from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutputsParams"]

_EXPORTS = {
    "LLM": "kvfleet.runtime.engine.llm",
    "EngineConfig": "kvfleet.runtime.config",
    "LoRARequest": "kvfleet.runtime.lora.request",
    "PoolingParams": "kvfleet.runtime.pooling_params",
    "SamplingParams": "kvfleet.runtime.sampling_params",
    "StructuredOutputsParams": "kvfleet.runtime.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy so that importing a light submodule (the CLI, the config) does not load torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
