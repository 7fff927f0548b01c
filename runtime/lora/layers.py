"""Batched LoRA on the model's projections: one forward pass serves the base model and several adapters.

Each step the runner says which tokens run with which adapter slot (`LoRABatch`); every adapted projection
then adds, per slot, `x[tokens] @ A[slot].T @ B[slot].T` to the base output of those tokens: the gather,
shrink and expand of Punica's segmented kernels, with the base matmul shared by the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvfleet.runtime.lora.adapter import FUSED_SLICES
from torch import nn


@dataclass
class LoRABatch:
    """This step's tokens per active slot: (slot, token rows), rows None when every token of the step uses
    that slot. Tokens of the base model appear in no group."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """A base projection plus the LoRA update of the adapters in its slots."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        # [max_loras, slices * max_rank, in_features] and [max_loras, out_features, slices * max_rank].
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.base(x)
        for slot, rows in self.batch.groups:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if rows is None:
                output.addmm_(x @ a.t(), b.t())
            else:
                output.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return output


def add_lora_layers(
    model: nn.Module,
    batch: LoRABatch,
    *,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[dict[str, LoRALinear]]:
    """Wrap every adaptable projection of a Llama-family model; returns each layer's wrapped projections,
    whose slots start empty (zeros: no update)."""
    wrapped: list[dict[str, LoRALinear]] = []
    for layer in model.layers:
        projections = {
            "qkv_proj": layer.self_attn,
            "o_proj": layer.self_attn,
            "gate_up_proj": layer.mlp,
            "down_proj": layer.mlp,
        }
        layer_wrapped: dict[str, LoRALinear] = {}
        for name, owner in projections.items():
            base = getattr(owner, name)
            width = len(FUSED_SLICES[name]) * max_rank
            lora_a = torch.zeros(max_loras, width, base.in_features, dtype=dtype, device=device)
            lora_b = torch.zeros(max_loras, base.out_features, width, dtype=dtype, device=device)
            module = LoRALinear(base, lora_a, lora_b, batch)
            setattr(owner, name, module)
            layer_wrapped[name] = module
        wrapped.append(layer_wrapped)
    return wrapped
