"""LoRA adapters by name: their cards in /v1/models, and loading and unloading them at run time (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, served only with --allow-runtime-lora-updates)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import BadRequestError, NotFoundError, PermissionDeniedError
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.lora.request import source_digest
from kvfleet.runtime.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

if TYPE_CHECKING:
    from kvfleet.runtime.serving.lora_adapters import LoRAAdapters
    from kvfleet.runtime.serving.service import OpenAIService


class OpenAIServingLoRA:
    def __init__(self, service: OpenAIService) -> None:
        self.service = service
        # One update at a time: a name checked free must still be free when the adapter is added.
        self._updating = asyncio.Lock()

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        adapters = self.service.lora_adapters
        if adapters is None:
            return []
        parent = self.service.model_name
        return [
            {
                "id": served.lora.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "kvfleet",
                # vLLM's root is the adapter's path; like the base model's card, this one names no path.
                "root": served.lora.lora_name,
                "parent": parent,
                # The operator compares it with the digest of the source it asks for.
                "source_digest": source_digest(served.source),
            }
            for served in adapters.loaded
        ]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        adapters = self._updatable()
        async with self._updating:
            try:
                # Reading and checking the weights takes a while: not on the event loop.
                await asyncio.to_thread(adapters.add, body.lora_name, body.lora_path)
            except LoRAAdapterError as exc:
                raise BadRequestError(str(exc), param="lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        adapters = self._updatable()
        async with self._updating:
            removed = adapters.remove(body.lora_name)
            if removed is None:
                raise NotFoundError(f"the LoRA adapter {body.lora_name!r} is not loaded", param="lora_name")
            if self.service.metrics is not None:
                self.service.metrics.forget_lora(body.lora_name)
            # The same files served under another name share the weights.
            if all(served.lora.lora_int_id != removed.lora_int_id for served in adapters.loaded):
                self.service.engine.remove_lora(removed.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _updatable(self) -> LoRAAdapters:
        adapters = self.service.lora_adapters
        if adapters is None or not self.service.settings.allow_runtime_lora_updates:
            raise PermissionDeniedError(
                "loading and unloading LoRA adapters at run time is off on this server "
                "(kvfleet serve --enable-lora --allow-runtime-lora-updates turns it on)"
            )
        return adapters
