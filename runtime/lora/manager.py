"""The adapters of one model runner: read into host memory on first use (least recently used ones dropped past
`max_cpu_loras`), copied into the model's `max_loras` slots when a step needs them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from kvfleet.runtime.lora.adapter import LoRAWeights, load_lora_weights
from kvfleet.runtime.lora.layers import LoRABatch, add_lora_layers
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.models.model_config import ModelConfig
from torch import nn


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool,
    ) -> None:
        """`use_triton`: run the Triton kernels instead of the dense torch path."""
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.batch = LoRABatch()
        self.layers = add_lora_layers(
            model,
            model_config,
            self.batch,
            max_loras=max_loras,
            max_rank=max_rank,
            dtype=dtype,
            device=device,
            use_triton=use_triton,
        )
        self.use_triton = use_triton
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()
        # Which adapter each slot holds, least recently used first.
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot
        self._free_slots = list(range(max_loras))

    def add(self, lora: LoRARequest) -> None:
        """Have the adapter in host memory; raises LoRAAdapterError when it cannot run on this model."""
        if lora.lora_int_id in self._host:
            self._host.move_to_end(lora.lora_int_id)
            return
        self._host[lora.lora_int_id] = load_lora_weights(
            lora.lora_path, self.model_config, max_rank=self.max_rank, dtype=self.dtype
        )
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def remove(self, lora_int_ids: list[int]) -> None:
        """Forget unloaded adapters: their host copy, and their slots, zeroed so that no later step computes
        with what they held."""
        for lora_int_id in lora_int_ids:
            self._host.pop(lora_int_id, None)
            slot = self._slots.pop(lora_int_id, None)
            if slot is None:
                continue
            for wrapped in self.layers:
                for module in wrapped.values():
                    module.set_slot(slot, None, None)
            self._free_slots.append(slot)

    def prepare(self, loras: list[LoRARequest | None], query_start_loc: Sequence[int]) -> None:
        """Put the step's adapters in slots and mark which tokens run with which slot."""
        self.batch.other_columns = self.batch.plan = None
        if all(lora is None for lora in loras):
            return
        for lora in loras:
            # Adapters already in slots first: the slots this step uses are then the most recently used.
            if lora is not None and lora.lora_int_id in self._slots:
                self._slots.move_to_end(lora.lora_int_id)
        token_slots = np.full(int(query_start_loc[len(loras)]), -1, dtype=np.int64)
        for index, lora in enumerate(loras):
            if lora is not None:
                token_slots[query_start_loc[index] : query_start_loc[index + 1]] = self._slot_for(lora)
        if self.use_triton:
            from kvfleet.runtime.kernels.lora import plan_lora_tokens

            self.batch.plan = plan_lora_tokens(token_slots, self.device)
            return
        slots = torch.from_numpy(token_slots).to(self.device)[:, None]
        slot_of_column = torch.arange(self.max_loras * self.max_rank, device=self.device) // self.max_rank
        self.batch.other_columns = slot_of_column != slots

    def _slot_for(self, lora: LoRARequest) -> int:
        slot = self._slots.get(lora.lora_int_id)
        if slot is not None:
            self._slots.move_to_end(lora.lora_int_id)
            return slot
        # The scheduler lets at most max_loras adapters into a step, and prepare() touched those already in
        # slots, so the least recently used slot is one this step does not use.
        slot = self._free_slots.pop() if self._free_slots else self._slots.popitem(last=False)[1]
        self.add(lora)
        weights = self._host[lora.lora_int_id]
        for wrapped, adapted in zip(self.layers, weights.layers, strict=True):
            for name, module in wrapped.items():
                module.set_slot(slot, *adapted.get(name, (None, None)))
        self._slots[lora.lora_int_id] = slot
        return slot
