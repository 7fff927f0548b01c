"""A rank's place among tensor- and pipeline-parallel ranks, and the collectives its model layers call.

Ranks are numbered stage-major: rank = pp_rank * tp_size + tp_rank, so the tensor-parallel ranks of one
stage are neighbours (on one node when a stage fits one). A process holds one ParallelContext; the model reads
it when it is built, so a model built outside a worker (tp = pp = 1) needs no torch.distributed at all.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # Only read for its shape: the models build their layers on this module, so it imports none of them.
    from kvfleet.runtime.models.model_config import ModelConfig

# A collective that waits longer than this for a peer fails, and the worker exits: a rank that hangs or dies
# takes the group down instead of leaving the others waiting forever.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)


@dataclass(frozen=True)
class ParallelContext:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    # Mixture-of-experts layers: each tensor-parallel rank holds whole experts (a 1/tp_size share of them)
    # instead of a 1/tp_size slice of every expert.
    enable_expert_parallel: bool = False
    # The group of this stage's tensor-parallel ranks, and that of all ranks (point-to-point between stages);
    # None without torch.distributed (in-process).
    tp_group: dist.ProcessGroup | None = None
    world_group: dist.ProcessGroup | None = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def previous_stage_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks (row-parallel outputs, the vocabulary-parallel
        embedding)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[n, c] on each rank -> [n, tp_size * c], rank order (vocabulary-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


_current = ParallelContext()


def parallel_context() -> ParallelContext:
    return _current


def set_parallel_context(context: ParallelContext) -> None:
    global _current
    _current = context


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` of `size` split in `parts` equal parts (size must divide)."""
    length = size // parts
    return index * length, length


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first id, padded length) of a rank's slice of the vocabulary: ceil(vocab / tp) ids each, the last
    slice padded past the vocabulary, so that every rank's logits have one width for all_gather."""
    length = -(-vocab_size // tp_size)
    return tp_rank * length, length


def local_kv_heads(config: ModelConfig, tp_size: int) -> int:
    """KV heads per tensor-parallel rank: a share of them, or one replicated head when ranks outnumber
    them."""
    return max(config.num_key_value_heads // tp_size, 1)


def kv_head_range(config: ModelConfig, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, count) a rank holds: the heads its query heads attend with."""
    kv_heads = config.num_key_value_heads
    if kv_heads >= tp_size:
        return shard_range(kv_heads, tp_size, tp_rank)
    return tp_rank * kv_heads // tp_size, 1


def check_model_fits(
    model_config: ModelConfig, tp_size: int, pp_size: int, *, enable_expert_parallel: bool = False
) -> None:
    """Raises ValueError naming the numbers when the model cannot be split tp x pp ways."""
    heads = model_config.num_attention_heads
    kv_heads = model_config.num_key_value_heads
    layers = model_config.num_hidden_layers
    intermediate = model_config.intermediate_size
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's {heads} attention heads"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} neither divides the model's {kv_heads} key/value heads nor is a "
            f"multiple of them (to replicate each on {tp_size} / {kv_heads} ranks)"
        )
    moe = model_config.moe
    has_dense_mlp = moe is None or not all(moe.sparse_layers)
    if has_dense_mlp and intermediate % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's intermediate size {intermediate}"
        )
    if layers % pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} does not divide the model's {layers} layers")
    if moe is None:
        return
    if enable_expert_parallel and moe.num_experts % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's {moe.num_experts} experts, as "
            "enable_expert_parallel needs (each rank holds whole experts)"
        )
    if not enable_expert_parallel and moe.moe_intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the experts' intermediate size "
            f"{moe.moe_intermediate_size} (enable_expert_parallel splits the experts between ranks instead)"
        )


def check_devices(local_ranks: int, device_type: str) -> None:
    """On CUDA each local rank takes one GPU: more ranks than GPUs are refused. CPU ranks are processes."""
    if device_type != "cuda":
        return
    count = torch.cuda.device_count()
    if local_ranks > count:
        raise ValueError(f"{local_ranks} ranks on this node need {local_ranks} GPUs, but it has {count}")
