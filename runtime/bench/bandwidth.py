"""A decode step against the memory-bandwidth bound.

A decode step of a few sequences reads every weight once and each sequence's KV, and computes little on
them: it can be no faster than those bytes over the rate at which this machine reads memory. A
mixture-of-experts step reads, of its experts, only those its tokens are routed to. The rate is
measured as the engine would see it, with torch's current thread count: a float32 buffer several times the
size of any last-level cache summed, best of several passes (a streaming read, as a step's weights are).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from kvfleet.runtime.models.layers import Linear
from kvfleet.runtime.models.llama import VocabParallelEmbedding
from kvfleet.runtime.models.moe import RoutedExperts
from torch import nn

# Eight times a 32 MB last-level cache: a pass reads from memory, not from cache.
_BUFFER_BYTES = 256 * 2**20
_PASSES = 6


def read_bandwidth() -> float:
    """Bytes per second a streaming read of memory achieves on torch's current threads (best pass)."""
    buffer = torch.ones(_BUFFER_BYTES // 4)
    buffer.sum()  # pages touched before the timed passes
    fastest = float("inf")
    for _ in range(_PASSES):
        start = time.perf_counter()
        buffer.sum()
        fastest = min(fastest, time.perf_counter() - start)
    return _BUFFER_BYTES / fastest


def weight_bytes(model: nn.Module, routed_expert_bytes: float | None = None) -> int:
    """Bytes of weights a step reads, each in its stored dtype (int8 weights and their scales as held, a
    projection repacked for oneDNN by its packed copy): all of them but an input embedding table that the LM
    head does not share, of which a step reads only its tokens' rows; of a mixture-of-experts model's experts,
    `routed_expert_bytes` (those of the experts a step routes tokens to), or all of them when None."""
    tied = getattr(model, "lm_head", None) is None
    skipped = {
        id(parameter)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, VocabParallelEmbedding)) and not tied
        for parameter in module.parameters()
    }
    if routed_expert_bytes is not None:
        skipped |= {
            id(parameter)
            for module in model.modules()
            if isinstance(module, RoutedExperts)
            for parameter in module.parameters()
        }
    tensors = [p for p in model.parameters() if id(p) not in skipped]
    packed = [m.packed_weight for m in model.modules() if isinstance(m, Linear)]
    tensors += [weight for weight in packed if weight is not None]
    return sum(t.numel() * t.element_size() for t in tensors) + round(routed_expert_bytes or 0)


def expert_bytes(experts: RoutedExperts) -> float:
    """Bytes of one of a layer's experts on this rank (its weights and scales, as held)."""
    held = sum(p.numel() * p.element_size() for p in experts.parameters())
    return held / len(experts.local_experts)


@dataclass
class BandwidthBound:
    """What one decode step reads and the time those bytes take at the measured bandwidth."""

    weight_bytes: int
    kv_bytes: int
    bytes_per_second: float

    @property
    def ideal_ms(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bytes_per_second * 1e3

    def share_of(self, step_ms: float) -> float:
        """The fraction of the bound a step of `step_ms` achieves: ideal time over measured."""
        return self.ideal_ms / step_ms
