"""Which LoRA adapter a request runs with (vLLM's LoRARequest), light enough for the engine's messages."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# What an adapter's name may look like: it travels in JSON bodies, URLs of clients and metric labels.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
ADAPTER_NAME_RULE = "letters, digits and . _ : / -, up to 128 characters"


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: which adapter a request runs with. `lora_int_id` identifies the adapter's weights: two
    requests with the same id share them and their prefix cache, so a new adapter needs a new id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError("lora_int_id must be at least 1 (0 is the base model)")


def source_digest(source: str) -> str:
    """What an adapter's card in /v1/models shows of its source (a folder or an hf:// URI): the operator
    compares it with the digest of the source it asks for, and clients see no path."""
    return hashlib.sha256(source.encode()).hexdigest()
