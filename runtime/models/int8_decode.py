"""A decode step's decoder layers in one C++ call, for Llama-family models with int8 projections on the CPU.

With int8 weights a batch-1 decode step of the `small` model spent less time in its projections than in the
Python between them (docs/benchmarks.md, "The decoder layers in one call"). `cpu_decode_layers.cpp` holds
the layers' weights and runs a step's layers with the same operations the model's forward calls, in the same
order, so both give the same results bit for bit. It takes steps whose every token is a decode that the CPU
attention kernel attends; prefill chunks, long contexts and other backends keep the model's forward.

A model is bound once loaded and after LoRA has wrapped the projections it adapts: a wrapped projection, a
mixture-of-experts block, float weights or a layer bound to other implementations keep the Python forward.
"""

from __future__ import annotations

import logging

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend, SdpaPlan
from kvfleet.runtime.kernels.cpu_build import CPU_DECODE, build_cpu_ops
from kvfleet.runtime.kernels.fused_layers import Implementation
from kvfleet.runtime.models.layers import RotaryStep
from kvfleet.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kvfleet.runtime.quantization.linear import Int8Linear
from torch import nn

logger = logging.getLogger(__name__)


class Int8DecodeLayers:
    """The model's decoder layers as one C++ object, for the steps it takes (`takes`)."""

    def __init__(self, model: LlamaForCausalLM, attention: SdpaAttentionBackend) -> None:
        spec = attention.spec
        self.layers = torch.classes.kvfleet_cpu_decode.Int8DecoderLayers(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, model.config.rms_norm_eps, spec.scale
        )
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                None if attn.q_norm is None else attn.q_norm.weight,
                None if attn.k_norm is None else attn.k_norm.weight,
                _parts(attn.qkv_proj),
                _parts(attn.o_proj),
                mlp.gate_up_proj.weight,
                mlp.gate_up_proj.weight_scale,
                mlp.down_proj.weight,
                mlp.down_proj.weight_scale,
                attn.sliding_window or 0,
            )

    @staticmethod
    def takes(plan: SdpaPlan) -> bool:
        """Whether every token of the step is a decode that the CPU attention kernel attends."""
        return plan.kernel_decodes is not None and not plan.prefill_chunks and not plan.tiled_requests

    def __call__(
        self, hidden: torch.Tensor, rotary: RotaryStep, kv_caches: list[torch.Tensor], plan: SdpaPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (hidden, residual), as the layers' forward leaves them."""
        decodes, metadata = plan.kernel_decodes, plan.metadata
        assert decodes is not None
        return self.layers.forward(
            hidden,
            rotary.rows,
            rotary.cos_sin_cache,
            kv_caches,
            plan.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            decodes.rows,
            decodes.requests,
        )


def bind_int8_decode_layers(model: nn.Module, attention: AttentionBackend) -> bool:
    """Give the model its decode layers in one call where every layer fits them; returns whether it did."""
    if not (
        type(model) is LlamaForCausalLM
        and isinstance(attention, SdpaAttentionBackend)
        and attention.decode_kernel is not None
        and model.parallel.tp_size * model.parallel.pp_size == 1
        and all(_fits(layer) for layer in model.layers)
        and build_cpu_ops(CPU_DECODE)
    ):
        return False
    model.int8_decode = Int8DecodeLayers(model, attention)
    logger.info("decode steps run the %d int8 decoder layers in one call", len(model.layers))
    return True


def _fits(layer: LlamaDecoderLayer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    on_cpu_ops = [attn.rotary_emb, *(norm for norm in norms if norm is not None)]
    if type(mlp) is not LlamaMLP or any(op.implementation is not Implementation.CPU for op in on_cpu_ops):
        return False
    projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    # Packed for the CPU kernel (`Int8Linear.pack_for_cpu`), and not wrapped (by LoRA, say).
    return all(type(p) is Int8Linear and p.weight.dim() == 3 for p in projections)


def _parts(projection: Int8Linear) -> list[torch.Tensor]:
    parts = [projection.weight, projection.weight_scale]
    return parts if projection.bias is None else [*parts, projection.bias]
