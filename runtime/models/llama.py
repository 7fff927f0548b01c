"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Q/K/V and gate/up projections are fused into one matmul each; checkpoint weights are stacked at load.

Tensor parallelism (Megatron's split): each rank holds its heads of the fused QKV projection and its columns
of gate/up (column-parallel), the matching rows of o_proj and down_proj (row-parallel, whose partial sums are
all-reduced), and a slice of the vocabulary for the embedding and the LM head. When there are fewer KV heads
than ranks, each KV head is replicated on the ranks whose query heads read it. Pipeline parallelism: a rank
holds its stage's layers; the first stage embeds, the last normalises and computes logits, and the stages in
between hand over (hidden, residual). Each rank reads only its slices of the checkpoint (`checkpoint_slice`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.distributed.parallel import (
    ParallelContext,
    kv_head_range,
    local_kv_heads,
    parallel_context,
    shard_range,
    vocab_shard,
)
from kvfleet.runtime.models.layers import (
    Linear,
    MRotaryEmbedding,
    RMSNorm,
    RotaryEmbedding,
    RotaryStep,
    SiluAndMul,
    copy_checkpoint_tensor,
)
from kvfleet.runtime.models.model_config import ModelConfig
from torch import nn

if TYPE_CHECKING:
    from kvfleet.runtime.models.cpu_decode_layers import CpuDecodeLayers


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_heads = config.num_attention_heads // parallel.tp_size
        self.num_kv_heads = local_kv_heads(config, parallel.tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # The model's one embedding, shared by every layer.
        self.rotary_emb = rotary_emb
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
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
            self.rotary_emb(rotary, q, k)
        else:
            # Each row of the QKV output holds q's heads then k's.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
            self.rotary_emb(rotary, q, k, qk)
        out = self.attention.forward(q, k, v, kv_cache, plan, sliding_window=self.sliding_window)
        return self.parallel.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        intermediate = config.intermediate_size // parallel.tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, config.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class VocabParallelEmbedding(nn.Module):
    """The embedding table, or on each tensor-parallel rank its slice of the vocabulary (padded to one width);
    ids outside the slice embed to zeros, and the all-reduce sums each token's one non-zero row."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.first_id, length = vocab_shard(vocab_size, parallel.tp_size, parallel.tp_rank)
        # Rows past the vocabulary stay zero: they are never looked up, and their logits are cut off.
        self.weight = nn.Parameter(torch.zeros(length, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_id
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(hidden)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        parallel: ParallelContext,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attention, rotary_emb, sliding_window, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryStep,
        kv_cache: torch.Tensor,
        plan: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, plan)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM: same graph, config switches."""

    # A CPU decode step's layers in one call, where the model's layers fit it (`models.cpu_decode_layers`).
    cpu_decode_layers: CpuDecodeLayers | None = None

    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel_context()
        num_layers = config.num_hidden_layers // parallel.pp_size
        self.first_layer = parallel.pp_rank * num_layers
        local_windows = config.layer_windows[self.first_layer : self.first_layer + num_layers]
        # The first stage embeds; the last reads the table as well when the LM head is tied to it.
        needs_embedding = parallel.is_first_stage or (parallel.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
            if needs_embedding
            else None
        )
        rotary_class = MRotaryEmbedding if config.uses_mrope else RotaryEmbedding
        self.rotary_emb = rotary = rotary_class(config.head_dim, max_position, config.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, attention, rotary, window, parallel, self.make_mlp(self.first_layer + i)
            )
            for i, window in enumerate(local_windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if parallel.is_last_stage else None
        self.lm_head: Linear | None = None
        if parallel.is_last_stage and not config.tie_word_embeddings:
            _, vocab_rows = vocab_shard(config.vocab_size, parallel.tp_size, parallel.tp_rank)
            self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False)
            nn.init.zeros_(self.lm_head.weight)  # rows past the vocabulary (see VocabParallelEmbedding)
        if config.o_proj_bias and parallel.tp_rank > 0:
            # A row-parallel bias is added once: by rank 0; the others' partial sums carry none.
            for layer in self.layers:
                nn.init.zeros_(layer.self_attn.o_proj.bias)

    def make_mlp(self, layer: int) -> nn.Module:
        """The feed-forward block of a layer (numbered in the whole model); mixture-of-experts models put
        their experts' block in its place."""
        return LlamaMLP(self.config, self.parallel)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]; with M-RoPE [3, num_tokens]
        kv_caches: list[torch.Tensor],
        plan: Any,
        sequence_lengths: torch.Tensor | None = None,  # [num_tokens], for rope types that read it
        stage_input: torch.Tensor | None = None,  # [2, num_tokens, hidden]: the previous stage's output
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size], instead of input_ids'
    ) -> torch.Tensor:
        """The last stage's normalised hidden states [num_tokens, hidden_size]; an earlier stage's output
        for the next one, (hidden, residual) stacked into [2, num_tokens, hidden_size]."""
        if stage_input is not None:
            hidden, residual = stage_input[0], stage_input[1]
        elif inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        else:
            assert self.embed_tokens is not None
            hidden, residual = self.embed_tokens(input_ids), None
        rotary = self.rotary_emb.prepare(positions, hidden.dtype, sequence_lengths=sequence_lengths)
        if self.cpu_decode_layers is not None and self.cpu_decode_layers.takes(plan):
            hidden, residual = self.cpu_decode_layers(hidden, rotary, kv_caches, plan)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, rotary, kv_cache, plan)
        if self.norm is None:
            return torch.stack((hidden, residual))
        return self.norm(hidden, residual)[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `input_ids`, into which prompt embeddings are placed."""
        assert self.embed_tokens is not None, "the first pipeline stage's"
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        if self.lm_head is None:
            assert self.embed_tokens is not None
            logits = torch.matmul(hidden, self.embed_tokens.weight.t())
        else:
            logits = self.lm_head(hidden)
        return self.parallel.all_gather_columns(logits)[:, : self.config.vocab_size].float()

    def checkpoint_slice(self, hf_name: str, shape: list[int]) -> tuple[slice, ...] | None:
        """The part of a checkpoint tensor this rank holds (all of it without parallelism), or None when it
        holds none of it (another stage's layer, a tied LM head, a bias another rank adds)."""
        parallel, config = self.parallel, self.config
        name = hf_name.removeprefix("model.")
        everything = tuple(slice(None) for _ in shape)
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            if not self.first_layer <= layer < self.first_layer + len(self.layers):
                return None
        elif name.startswith("embed_tokens."):
            if self.embed_tokens is None:
                return None
        elif name.startswith("lm_head."):
            if self.lm_head is None:
                return None
        elif name.startswith("norm.") and self.norm is None:
            return None
        tp_size, tp_rank = parallel.tp_size, parallel.tp_rank
        if (
            tp_size == 1
            or name.endswith(".weight_shape")
            or (name.endswith(".weight_scale") and len(shape) == 1)
        ):
            # A packed weight's shape and a weight's one scale (fp8's per-tensor strategy) go to every rank.
            return everything
        if name.startswith(("embed_tokens.", "lm_head.")):
            first, length = vocab_shard(config.vocab_size, tp_size, tp_rank)
            return (slice(first, first + length), *everything[1:])
        if ".q_proj." in name:
            return _rows(everything, *shard_range(shape[0], tp_size, tp_rank))
        if ".k_proj." in name or ".v_proj." in name:
            first_head, heads = kv_head_range(config, tp_size, tp_rank)
            return _rows(everything, first_head * config.head_dim, heads * config.head_dim)
        if ".gate_proj." in name or ".up_proj." in name:
            return _rows(everything, *shard_range(shape[0], tp_size, tp_rank))
        if ".o_proj.weight" in name or ".down_proj.weight" in name:
            return input_columns(name, shape[1], tp_size, tp_rank)
        if ".o_proj.bias" in name and tp_rank > 0:
            return None
        return everything  # norms and the o_proj bias of rank 0: whole on every rank

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors (this rank's slices of them) in, stacking q/k/v and gate/up
        into their fused projections.

        Raises ValueError naming the tensor for unknown names, wrong shapes, or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # recomputed from the config
            if self.config.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # tied checkpoints sometimes store the shared matrix twice
            name, rows = self._place(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            target = params[name].data if rows is None else params[name].data.narrow(0, *rows)
            if name.startswith(("embed_tokens.", "lm_head.")):
                # The last vocabulary slice may be padded: its rows past the vocabulary hold zeros (a
                # quantized LM head's scales too, NaN until loaded), whose logits the gather cuts off.
                target[tensor.shape[0] :].zero_()
                target = target[: tensor.shape[0]]
            copy_checkpoint_tensor(target, tensor, hf_name)
            loaded.add(hf_name)
        missing = sorted(set(self._expected_checkpoint_names()) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:4])}")

    def parameter_of(self, hf_name: str) -> str:
        """The parameter a checkpoint tensor is copied into (a fused projection's, for the stacked ones)."""
        return self._place(hf_name)[0]

    def _place(self, hf_name: str) -> tuple[str, tuple[int, int] | None]:
        """Where a checkpoint tensor goes: (parameter name, (first row, rows) of a fused one or None)."""
        name = hf_name.removeprefix("model.")
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            name = f"layers.{int(index) - self.first_layer}.{rest}"
        config, tp_size = self.config, self.parallel.tp_size
        q_rows = config.num_attention_heads // tp_size * config.head_dim
        kv_rows = local_kv_heads(config, tp_size) * config.head_dim
        intermediate = config.intermediate_size // tp_size
        stacked = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, intermediate),
            "mlp.up_proj": ("mlp.gate_up_proj", intermediate, intermediate),
        }
        for part, (fused, start, rows) in stacked.items():
            if f".{part}." in name:
                return name.replace(part, fused), (start, rows)
        return name, None

    def _expected_checkpoint_names(self) -> list[str]:
        """The checkpoint tensors this rank must have read."""
        config = self.config
        names = []
        if self.embed_tokens is not None:
            names.append("model.embed_tokens.weight")
        if self.norm is not None:
            names.append("model.norm.weight")
        if self.lm_head is not None:
            names.append("lm_head.weight")
        projections = ["q_proj", "k_proj", "v_proj"]
        for i in range(self.first_layer, self.first_layer + len(self.layers)):
            prefix = f"model.layers.{i}"
            names += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
            names += [f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            names += [f"{prefix}.self_attn.{p}.weight" for p in [*projections, "o_proj"]]
            if config.attention_bias:
                names += [f"{prefix}.self_attn.{p}.bias" for p in projections]
            if config.o_proj_bias and self.parallel.tp_rank == 0:
                names.append(f"{prefix}.self_attn.o_proj.bias")
            if config.qk_norm:
                names += [f"{prefix}.self_attn.q_norm.weight", f"{prefix}.self_attn.k_norm.weight"]
        return names


def _rows(everything: tuple[slice, ...], start: int, length: int) -> tuple[slice, ...]:
    return (slice(start, start + length), *everything[1:])


def input_columns(name: str, columns: int, tp_size: int, tp_rank: int) -> tuple[slice, slice]:
    """A row-parallel projection's share of its input columns: of its weight (a packed one's words), and of a
    quantized one's scales where there is one per group of columns (with one per output channel, every rank
    holds them whole). A word or a group split between two ranks could be read by neither."""
    if name.endswith(".weight_scale") and columns == 1:
        return slice(None), slice(None)
    if name.endswith((".weight_scale", ".weight_packed")) and columns % tp_size:
        what = "groups of input columns" if name.endswith(".weight_scale") else "words of packed columns"
        raise ValueError(f"{name}: tensor_parallel_size {tp_size} does not divide its {columns} {what}")
    start, length = shard_range(columns, tp_size, tp_rank)
    return slice(None), slice(start, start + length)
