"""Attention backends by name, imported on first use so that a missing optional dependency only
disqualifies the backend that needs it."""

from __future__ import annotations

import importlib
import logging

from kvfleet.runtime.attention.backend import AttentionBackend, AttentionSpec

logger = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "reference": "kvfleet.runtime.attention.reference:ReferenceAttentionBackend",
    "sdpa": "kvfleet.runtime.attention.sdpa:SdpaAttentionBackend",
    "triton": "kvfleet.runtime.attention.triton_backend:TritonAttentionBackend",
}


def load_backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    module_name, attribute = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), attribute)


def unsupported_reason(name: str, spec: AttentionSpec) -> str | None:
    try:
        cls = load_backend_class(name)
    except ImportError as exc:
        return f"cannot be imported: {exc}"
    return cls.unsupported_reason(spec)
