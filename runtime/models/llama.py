"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Q/K/V and gate/up projections are fused into one matmul each; checkpoint weights are stacked at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.kernels import fused_layers
from kvfleet.runtime.models.layers import Linear, RMSNorm, RotaryEmbedding, RotaryStep, silu_and_mul
from kvfleet.runtime.models.model_config import ModelConfig
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attention = attention
        self.sliding_window = sliding_window

    def forward(
        self, hidden: torch.Tensor, rotary: RotaryStep, kv_cache: torch.Tensor, plan: Any
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = _rms_norm(self.q_norm, q)[0]
            k = _rms_norm(self.k_norm, k)[0]
        if rotary.cos_sin is None:
            fused_layers.rotary_embedding_(rotary.rows, q, k, rotary.cos_sin_cache)
        elif self.q_norm is None:
            # Each row of the QKV output holds q's heads then k's: one rotation of that span turns both.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
            RotaryEmbedding.rotate_(qk, *rotary.cos_sin)
        else:
            RotaryEmbedding.rotate_(q, *rotary.cos_sin)
            RotaryEmbedding.rotate_(k, *rotary.cos_sin)
        out = self.attention.forward(q, k, v, kv_cache, plan, sliding_window=self.sliding_window)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        activated = (
            fused_layers.silu_and_mul(gate_up) if fused_layers.enabled(gate_up) else silu_and_mul(gate_up)
        )
        return self.down_proj(activated)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, sliding_window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attention, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryStep,
        kv_cache: torch.Tensor,
        plan: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = _rms_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, plan)
        hidden, residual = _rms_norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM: same graph, config switches."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention, window) for window in config.layer_windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_position, config.rope)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        plan: Any,
        sequence_lengths: torch.Tensor | None = None,  # [num_tokens], for rope types that read it
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size], instead of input_ids'
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary_emb.prepare(
            positions, hidden.dtype, fused=fused_layers.enabled(hidden), sequence_lengths=sequence_lengths
        )
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rotary, kv_cache, plan)
        return _rms_norm(self.norm, hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        if self.lm_head is None:
            return torch.matmul(hidden, self.embed_tokens.weight.t()).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors in, stacking q/k/v and gate/up into their fused projections.

        Raises ValueError naming the tensor for unknown names, wrong shapes, or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # recomputed from the config
            if self.lm_head is None and hf_name == "lm_head.weight":
                continue  # tied checkpoints sometimes store the shared matrix twice
            name, rows = self._place(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            target = params[name].data if rows is None else params[name].data.narrow(0, *rows)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(hf_name)
        missing = sorted(set(self._expected_checkpoint_names()) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:4])}")

    def _place(self, hf_name: str) -> tuple[str, tuple[int, int] | None]:
        """Where a checkpoint tensor goes: (parameter name, (first row, rows) of a fused one or None)."""
        name = hf_name.removeprefix("model.")
        config = self.config
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        stacked = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, config.intermediate_size),
            "mlp.up_proj": ("mlp.gate_up_proj", config.intermediate_size, config.intermediate_size),
        }
        for part, (fused, start, rows) in stacked.items():
            if f".{part}." in name:
                return name.replace(part, fused), (start, rows)
        return name, None

    def _expected_checkpoint_names(self) -> list[str]:
        config = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.lm_head is not None:
            names.append("lm_head.weight")
        projections = ["q_proj", "k_proj", "v_proj"]
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            names += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
            names += [f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            names += [f"{prefix}.self_attn.{p}.weight" for p in [*projections, "o_proj"]]
            if config.attention_bias:
                names += [f"{prefix}.self_attn.{p}.bias" for p in projections]
            if config.o_proj_bias:
                names.append(f"{prefix}.self_attn.o_proj.bias")
            if config.qk_norm:
                names += [f"{prefix}.self_attn.q_norm.weight", f"{prefix}.self_attn.k_norm.weight"]
        return names


def _rms_norm(
    layer: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if fused_layers.enabled(x):
        return fused_layers.rms_norm(x, layer.weight, layer.eps, residual)
    return layer(x, residual)
