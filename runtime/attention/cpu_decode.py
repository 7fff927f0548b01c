"""The CPU's paged decode attention kernel (cpu_decode_attention.cpp), compiled on first use.

The kernel attends each decode's one query token over its context straight from the paged KV cache, where
the portable path gathers the blocks into a padded copy first. It is built for this host by
`kvfleet.runtime.kernels.cpu_build`; a host that cannot build it keeps the portable path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from kvfleet.runtime.kernels.cpu_build import CPU_ATTENTION, build_cpu_ops

# (out, query, key_cache, value_cache, block_tables, seq_lens, decode_rows, decode_requests, scale, window)
PagedDecodeAttention = Callable[..., None]


def cpu_kernel_supports_head_size(head_dim: int) -> bool:
    """The kernel works on vectors of 16 floats: head sizes 16, 32, ... 256."""
    return head_dim % 16 == 0 and head_dim <= 256


@functools.cache
def load_paged_decode_attention() -> PagedDecodeAttention | None:
    """The kernel as a torch op, built unless this host's build is cached; None if it cannot be built."""
    if not build_cpu_ops(CPU_ATTENTION):
        return None
    return torch.ops.kvfleet_cpu.paged_decode_attention
