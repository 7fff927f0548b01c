"""The LoRA adapters an API server serves by name: from --lora-modules at start, and loaded or unloaded at run
time through /v1/load_lora_adapter and /v1/unload_lora_adapter.

An adapter is checked against the base model when it is registered, so a bad one is refused with a 400 and
never reaches the engine. Its `lora_int_id` comes from a digest of its files: every API server process gives
the same adapter the same id, and an adapter replaced on disk gets a new one (and never the old one's KV).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from kvfleet.runtime.lora.adapter import adapter_digest, load_lora_weights
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.models.model_config import ModelConfig

# What a model name may look like: it travels in JSON bodies, URLs of clients and metric labels.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class LoRAModule:
    """`--lora-modules name=path`."""

    name: str
    path: str

    @classmethod
    def parse(cls, value: str) -> LoRAModule:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {value!r}")
        return cls(name, path)


class LoRAAdapters:
    def __init__(self, model: str, served_model_name: str, *, max_rank: int) -> None:
        self.model_config = ModelConfig.from_folder(model)
        self.served_model_name = served_model_name
        self.max_rank = max_rank
        self._by_name: dict[str, LoRARequest] = {}

    @property
    def loaded(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter and serve it under `name`; raises LoRAAdapterError saying what is wrong."""
        if not _NAME.match(name):
            raise LoRAAdapterError(
                f"{name!r} is not a valid adapter name (letters, digits and . _ : / -, up to 128 characters)"
            )
        if name == self.served_model_name or name in self._by_name:
            raise LoRAAdapterError(f"the name {name!r} is already in use")
        digest = adapter_digest(path)
        load_lora_weights(path, self.model_config, max_rank=self.max_rank, dtype=torch.float32)
        lora = LoRARequest(name, int(digest[:15], 16) + 1, path)
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name`; requests already running with it finish with it."""
        return self._by_name.pop(name, None)
