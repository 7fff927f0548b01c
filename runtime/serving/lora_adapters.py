"""The LoRA adapters an API server serves by name: from --lora-modules at start, and loaded or unloaded at run
time through /v1/load_lora_adapter and /v1/unload_lora_adapter.

An adapter's source is a folder, or with --lora-download-dir an `hf://org/name[@revision]` URI that is
fetched into that folder first (how the operator delivers hub adapters to running replicas). The platform
may bound both (AdapterSources): folders to those under --allowed-local-lora-path, hub adapters to the
organisations of --allowed-lora-hub-orgs. Sources are never shown to clients: an adapter's card gives the
digest of its source, which is how the operator tells whether a replica serves the source it wants.

An adapter is checked against the base model when it is registered, so a bad one is refused with a 400 and
never reaches the engine. Its `lora_int_id` comes from a digest of its files: every API server process gives
the same adapter the same id, and an adapter replaced on disk gets a new one (and never the old one's KV).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvfleet.runtime.hub import HubError, HubRepository, download, parse_hf_uri
from kvfleet.runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, adapter_digest, load_lora_weights
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.lora.request import ADAPTER_NAME, ADAPTER_NAME_RULE, LoRARequest
from kvfleet.runtime.models.model_config import ModelConfig

# The most adapter names one server serves. Each name has its series in /metrics (about 1 KB with the longest
# names), which the operator reads up to 1 MiB and the gateway reads to route adapters: at this bound the
# page stays far below that. spec.adapters of an InferenceService has the same bound.
MAX_SERVED_ADAPTERS = 256


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


@dataclass(frozen=True)
class AdapterSources:
    """Where adapters may come from; None leaves that kind unbounded (vLLM's behaviour)."""

    # Local adapters: folders under it, their files too once symlinks are followed; a relative path is
    # taken from here.
    local_root: Path | None = None
    # Hub adapters: repositories of these organisations only.
    hub_orgs: frozenset[str] | None = None

    def local_folder(self, source: str) -> str:
        """The folder to read; raises LoRAAdapterError for one outside local_root."""
        if self.local_root is None:
            return source
        root = self.local_root.resolve()
        folder = (root / source).resolve()
        for path in (folder, folder / CONFIG_FILE, folder / WEIGHTS_FILE):
            if not path.resolve().is_relative_to(root):
                raise LoRAAdapterError(
                    f"{source}: adapters are read only from under --allowed-local-lora-path"
                )
        return str(folder)

    def check_hub(self, uri: str, repository: HubRepository) -> None:
        """Raises LoRAAdapterError for a repository of an organisation that is not allowed."""
        org = repository.repo_id.partition("/")[0]
        if self.hub_orgs is not None and org not in self.hub_orgs:
            raise LoRAAdapterError(f"{uri}: hub adapters are fetched only from --allowed-lora-hub-orgs")


@dataclass(frozen=True)
class ServedAdapter:
    lora: LoRARequest
    # As it was given: a folder, or the hf:// URI that `lora.lora_path` was fetched from. Never shown.
    source: str


class LoRAAdapters:
    def __init__(
        self,
        model: str,
        served_model_names: tuple[str, ...],
        *,
        max_rank: int,
        hf_overrides: dict[str, Any] | None = None,
        download_dir: str | None = None,
        sources: AdapterSources = AdapterSources(),
    ) -> None:
        self.model_config = ModelConfig.from_folder(model, hf_overrides)
        # The base model's names, which no adapter may take.
        self.served_model_names = served_model_names
        self.max_rank = max_rank
        self.download_dir = Path(download_dir) if download_dir is not None else None
        self.sources = sources
        self._by_name: dict[str, ServedAdapter] = {}

    @property
    def loaded(self) -> list[ServedAdapter]:
        return list(self._by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        served = self._by_name.get(name)
        return served.lora if served is not None else None

    def add(self, name: str, source: str) -> LoRARequest:
        """Check the adapter and serve it under `name`; raises LoRAAdapterError saying what is wrong."""
        if not ADAPTER_NAME.match(name):
            raise LoRAAdapterError(f"{name!r} is not a valid adapter name ({ADAPTER_NAME_RULE})")
        if name in self.served_model_names or name in self._by_name:
            raise LoRAAdapterError(f"the name {name!r} is already in use")
        if len(self._by_name) >= MAX_SERVED_ADAPTERS:
            raise LoRAAdapterError(
                f"this server serves {MAX_SERVED_ADAPTERS} adapters already: unload one first"
            )
        path = self._fetch(source) if source.startswith("hf://") else self.sources.local_folder(source)
        digest = adapter_digest(path)
        load_lora_weights(path, self.model_config, max_rank=self.max_rank, dtype=torch.float32)
        lora = LoRARequest(name, int(digest[:15], 16) + 1, path)
        self._by_name[name] = ServedAdapter(lora, source)
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name`; requests already running with it finish with it."""
        served = self._by_name.pop(name, None)
        return served.lora if served is not None else None

    def _fetch(self, uri: str) -> str:
        if self.download_dir is None:
            raise LoRAAdapterError(f"{uri}: adapters from the hub need kvfleet serve --lora-download-dir")
        try:
            repository = parse_hf_uri(uri)
            self.sources.check_hub(uri, repository)
            # One folder per URI: fetching the same one again finds it complete.
            folder = self.download_dir / hashlib.sha256(uri.encode()).hexdigest()[:16]
            return str(download(repository, folder, must_contain="adapter_config.json"))
        except HubError as exc:
            raise LoRAAdapterError(str(exc)) from None
