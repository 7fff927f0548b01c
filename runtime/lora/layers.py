"""Batched LoRA on the model's projections: one forward pass serves the base model and several adapters.

The slots of every adapter sit side by side, `max_rank` columns each. Each adapted projection runs, for the
whole batch, one shrink matmul (x @ A.T: every token's input under every slot, per slice of a fused
projection), keeps each token's own slot with a mask (nothing for base-model tokens), and one expand matmul
per slice into that slice's rows of the output. This is Punica's gather, shrink and expand done densely:
the LoRA matmuls are small next to the base one, so a few times their FLOPs costs less than indexing each
adapter's tokens apart in every layer, and the number of operations per step does not grow with the number
of adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvfleet.runtime.lora.adapter import FUSED_SLICES, projection_sizes
from kvfleet.runtime.models.model_config import ModelConfig
from torch import nn


@dataclass
class LoRABatch:
    """This step's token mask [num_tokens, slots * max_rank]: 1 on the columns of each token's own slot;
    None when no token of the step uses an adapter."""

    mask: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A base projection plus the LoRA update of the adapters in its slots."""

    def __init__(
        self,
        base: nn.Module,
        slice_sizes: list[int],
        batch: LoRABatch,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.max_rank = max_rank
        # Each slice's rows of the fused output.
        self.slice_rows: list[slice] = []
        start = 0
        for size in slice_sizes:
            self.slice_rows.append(slice(start, start + size))
            start += size
        self.slot_columns = max_loras * max_rank
        # A: slice-major, then slot; B: the slot's columns.
        self.lora_a = torch.zeros(
            len(slice_sizes) * self.slot_columns, base.in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(base.out_features, self.slot_columns, dtype=dtype, device=device)

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's (A, B) in `slot`, or clear it (None: the adapter leaves this projection alone)."""
        rank = self.max_rank
        columns = slice(slot * rank, (slot + 1) * rank)
        for index in range(len(self.slice_rows)):
            rows = self.lora_a[index * self.slot_columns :][columns]
            if a is None:
                rows.zero_()
            else:
                rows.copy_(a[index * rank : (index + 1) * rank])
        if b is None:
            self.lora_b[:, columns].zero_()
        else:
            self.lora_b[:, columns].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.base(x)
        mask = self.batch.mask
        if mask is None:
            return output
        shrunk = (x @ self.lora_a.t()).view(x.shape[0], len(self.slice_rows), self.slot_columns)
        shrunk.mul_(mask[:, None, :])
        for index, rows in enumerate(self.slice_rows):
            output[:, rows].addmm_(shrunk[:, index], self.lora_b[rows].t())
        return output


def add_lora_layers(
    model: nn.Module,
    model_config: ModelConfig,
    batch: LoRABatch,
    *,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[dict[str, LoRALinear]]:
    """Wrap every adaptable projection of a Llama-family model; returns each layer's wrapped projections,
    whose slots start empty (zeros: no update)."""
    sizes = projection_sizes(model_config)
    wrapped: list[dict[str, LoRALinear]] = []
    for layer in model.layers:
        owners = {
            "qkv_proj": layer.self_attn,
            "o_proj": layer.self_attn,
            "gate_up_proj": layer.mlp,
            "down_proj": layer.mlp,
        }
        layer_wrapped: dict[str, LoRALinear] = {}
        for name, owner in owners.items():
            module = LoRALinear(
                getattr(owner, name),
                [sizes[part][1] for part in FUSED_SLICES[name]],
                batch,
                max_loras=max_loras,
                max_rank=max_rank,
                dtype=dtype,
                device=device,
            )
            setattr(owner, name, module)
            layer_wrapped[name] = module
        wrapped.append(layer_wrapped)
    return wrapped
