"""xgrammar's token bitmask layout: bit i % 32 of int32 word i // 32 stands for token i (1 = allowed).

Written here rather than asked of xgrammar, whose import (it brings Transformers) would otherwise be paid by
every engine at start, constrained or not."""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    """The int32 words of one bitmask row."""
    return -(-vocab_size // 32)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A [vocab] boolean tensor as one bitmask row."""
    width = bitmask_width(allowed.shape[0])
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
