"""A CPU decode step's decoder layers in one C++ call, for Llama-family models (mixture-of-experts ones
among them) in float32 or with int8 projections.

At batch 1 a decode step of the `small` model with int8 weights spent less time in its projections than in the
Python between them (docs/benchmarks.md, "The decoder layers in one call"). `cpu_decode_layers.cpp` holds the
layers' weights and runs a step's layers with the same operations the model's forward calls, in the same
order, so both give the same results bit for bit. It takes steps whose every token is a decode that the CPU
attention kernel attends; prefill chunks, long contexts and other backends keep the model's forward.

A model is bound once loaded, after LoRA has wrapped the projections it adapts: a wrapped projection,
another dtype than float32, or a layer bound to other implementations keeps the Python forward. Int8
projections run the fused kernel for as many rows as the model's own do (`FUSED_MAX_ROWS`); a larger batch
keeps the Python forward, which dequantizes them instead.
"""

from __future__ import annotations

import logging

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend, SdpaPlan
from kvfleet.runtime.kernels.cpu_build import CPU_DECODE, build_cpu_ops
from kvfleet.runtime.kernels.fused_layers import Implementation
from kvfleet.runtime.models.layers import Linear, RotaryStep
from kvfleet.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kvfleet.runtime.models.moe import FusedMoE, Int8Experts, MoeForCausalLM, SparseMoeBlock, grouped_mm_fits
from kvfleet.runtime.quantization.linear import FUSED_MAX_ROWS, Int8Linear, feature_block
from torch import nn

logger = logging.getLogger(__name__)


class CpuDecodeLayers:
    """The model's decoder layers as one C++ object, for the steps it takes (`takes`)."""

    def __init__(self, model: LlamaForCausalLM, attention: SdpaAttentionBackend) -> None:
        spec = attention.spec
        self.layers = torch.classes.kvfleet_cpu_decode.DecoderLayers(
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            model.config.rms_norm_eps,
            spec.scale,
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
                attn.sliding_window or 0,
            )
            if isinstance(mlp, SparseMoeBlock):
                self._add_sparse_mlp(mlp)
            else:
                self.layers.add_dense_mlp(_parts(mlp.gate_up_proj), _parts(mlp.down_proj))
        quantized = any(isinstance(module, Int8Linear) for module in model.modules())
        # The most tokens a step may have: as many as the model's int8 projections run the fused kernel for.
        self.max_tokens = FUSED_MAX_ROWS[feature_block()] if quantized else None

    def takes(self, plan: SdpaPlan) -> bool:
        """Whether every token of the step is a decode that the CPU attention kernel attends, and there are
        no more of them than the int8 projections' fused kernel runs."""
        if self.max_tokens is not None and plan.slot_mapping.numel() > self.max_tokens:
            return False
        return plan.kernel_decodes is not None and not plan.prefill_chunks and not plan.tiled_requests

    def _add_sparse_mlp(self, block: SparseMoeBlock) -> None:
        experts = block.experts
        if isinstance(experts, FusedMoE):
            weights = [[experts.w13_weight], [experts.w2_weight], [], []]
        else:
            assert isinstance(experts, Int8Experts)
            weights = [
                [projection.weight for projection in experts.w13],
                [projection.weight for projection in experts.w2],
                [projection.weight_scale for projection in experts.w13],
                [projection.weight_scale for projection in experts.w2],
            ]
        self.layers.add_sparse_mlp(
            _parts(block.gate),
            block.moe.num_experts_per_tok,
            block.moe.norm_topk_prob,
            block.expert_tokens,
            *weights,
        )

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


def bind_cpu_decode_layers(model: nn.Module, attention: AttentionBackend) -> bool:
    """Give the model its decoder layers in one call where every layer fits them; returns whether it did."""
    if not (
        type(model) in (LlamaForCausalLM, MoeForCausalLM)
        and isinstance(attention, SdpaAttentionBackend)
        and attention.decode_kernel is not None
        and model.parallel.tp_size * model.parallel.pp_size == 1
        and all(_fits(layer) for layer in model.layers)
    ):
        return False
    if not build_cpu_ops(CPU_DECODE):
        return False
    model.cpu_decode_layers = CpuDecodeLayers(model, attention)
    logger.info("decode steps run the %d decoder layers in one call", len(model.layers))
    return True


def _fits(layer: LlamaDecoderLayer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    ops = [attn.rotary_emb, *(norm for norm in norms if norm is not None)]
    projections = [attn.qkv_proj, attn.o_proj]
    if type(mlp) is LlamaMLP:
        projections += [mlp.gate_up_proj, mlp.down_proj]
    elif type(mlp) is SparseMoeBlock and type(mlp.experts) in (FusedMoE, Int8Experts):
        experts = mlp.experts
        ops.append(experts.act_fn)
        projections.append(mlp.gate)
        if isinstance(experts, FusedMoE):
            # The stacks' row strides are also those of the rows they multiply (hidden and intermediate).
            if not grouped_mm_fits(experts.w13_weight, experts.w2_weight):
                return False
            ops.append(experts.grouped_linear)
        else:
            projections += [*experts.w13, *experts.w2]
    else:
        return False
    if any(op.implementation is not Implementation.CPU for op in ops):
        return False
    # Not wrapped (by LoRA, say), and int8 ones packed for the CPU kernel (`Int8Linear.pack_for_cpu`); the
    # layer operations' implementation says the model is float32.
    return all((type(p) is Int8Linear and p.weight.dim() == 3) or type(p) is Linear for p in projections)


def _parts(projection: nn.Module) -> list[torch.Tensor | None]:
    """[weight, scale, bias, padding rows] as the C++ layers take a projection."""
    if isinstance(projection, Int8Linear):
        return [projection.weight, projection.weight_scale, projection.bias, None]
    assert isinstance(projection, Linear)
    if projection.packed_weight is None:
        return [projection.weight, None, projection.bias, None]
    return [projection.packed_weight, None, projection.bias, projection.padding_rows]
