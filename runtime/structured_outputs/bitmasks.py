"""xgrammar's token bitmask layout: bit i % 32 of int32 word i // 32 stands for token i (1 = allowed)."""

from __future__ import annotations

import torch
import xgrammar


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A [vocab] boolean tensor as one bitmask row."""
    width = xgrammar.get_bitmask_shape(1, allowed.shape[0])[1]
    padded = torch.zeros(width * 32, dtype=torch.int64)
    padded[: allowed.shape[0]] = allowed.to(torch.int64)
    words = (padded.view(width, 32) << torch.arange(32)).sum(dim=1)
    # Words above 2**31 wrap to the negative int32 of the same bits.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def clear_bits(row: torch.Tensor, token_ids: list[int]) -> None:
    """Forbid `token_ids` in one bitmask row, in place."""
    for token_id in token_ids:
        cleared = ~(1 << (token_id % 32)) & 0xFFFFFFFF
        row[token_id // 32] &= cleared - 2**32 if cleared >= 2**31 else cleared
