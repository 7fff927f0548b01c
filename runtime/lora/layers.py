"""Batched LoRA on the model's projections: one forward pass serves the base model and several adapters.

The slots of every adapter sit side by side, `max_rank` columns each. A layer binds one of two
implementations when it is built:

- dense torch (the CPU): for the whole batch, one shrink matmul (x @ A.T: every token's input under every
  slot, per slice of a fused projection), a mask that keeps each token's own slot (nothing for base-model
  tokens), and one expand matmul per slice into that slice's rows of the output. This is Punica's gather,
  shrink and expand done densely: the LoRA matmuls are small next to the base one, so a few times their
  FLOPs costs less than indexing each adapter's tokens apart in every layer;
- the Triton kernels (`kvfleet.runtime.kernels.lora`, on CUDA): each adapter's tokens gathered, shrunk with
  its own A and expanded with its own B, so the work grows with the tokens, not with tokens times slots.

Either way the number of operations per step does not grow with the number of adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.lora.adapter import FUSED_SLICES, projection_sizes
from kvfleet.runtime.models.model_config import ModelConfig
from torch import nn

if TYPE_CHECKING:
    from kvfleet.runtime.kernels.lora import LoRATokenPlan


@dataclass
class LoRABatch:
    """This step's adapter layout, built once and read by every layer; both None when no token of the step
    uses an adapter.

    `other_columns` [num_tokens, slots * max_rank], for the dense path: True on the columns of every slot but
    the token's own (all of them for base-model tokens). They are filled with zeros rather than multiplied by
    them, so that what another slot computes, even an overflow in half precision, never reaches the token.
    `plan`, for the Triton kernels: the tokens grouped by slot.
    """

    other_columns: torch.Tensor | None = None
    plan: LoRATokenPlan | None = None


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
        use_triton: bool,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.max_rank = max_rank
        self.slice_sizes = slice_sizes
        # Each slice's rows of the fused output.
        self.slice_rows: list[slice] = []
        start = 0
        for size in slice_sizes:
            self.slice_rows.append(slice(start, start + size))
            start += size
        self.slice_starts = torch.tensor([0, *(rows.stop for rows in self.slice_rows)], dtype=torch.int32).to(
            device
        )
        # add_lora(x, output): adds this step's LoRA update into output in place, by the implementation bound
        # here for the layer's life.
        if use_triton:
            # Imported here: Triton is loaded only by the processes that run its kernels.
            from kvfleet.runtime.kernels.lora import add_lora_

            self._triton_add_lora = add_lora_
            self.add_lora = self._add_lora_triton
        else:
            self.add_lora = self._add_lora_dense
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
        self.add_lora(x, output)
        return output

    def _add_lora_dense(self, x: torch.Tensor, output: torch.Tensor) -> None:
        other_columns = self.batch.other_columns
        if other_columns is None:
            return
        shrunk = (x @ self.lora_a.t()).view(x.shape[0], len(self.slice_rows), self.slot_columns)
        shrunk.masked_fill_(other_columns[:, None, :], 0)
        for index, rows in enumerate(self.slice_rows):
            output[:, rows].addmm_(shrunk[:, index], self.lora_b[rows].t())

    def _add_lora_triton(self, x: torch.Tensor, output: torch.Tensor) -> None:
        plan = self.batch.plan
        if plan is None:
            return
        self._triton_add_lora(
            output, x, self.lora_a, self.lora_b, plan, self.slice_sizes, self.slice_starts, rank=self.max_rank
        )


def add_lora_layers(
    model: nn.Module,
    model_config: ModelConfig,
    batch: LoRABatch,
    *,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    use_triton: bool,
) -> list[dict[str, LoRALinear]]:
    """Wrap every adaptable projection of a Llama-family model; returns each layer's wrapped projections,
    whose slots start empty (zeros: no update). `use_triton` binds the Triton kernels instead of torch."""
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
                use_triton=use_triton,
            )
            setattr(owner, name, module)
            layer_wrapped[name] = module
        wrapped.append(layer_wrapped)
    return wrapped
