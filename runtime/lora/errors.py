"""The LoRA error API servers raise without loading torch."""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this model: the message says why."""
