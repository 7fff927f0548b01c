"""xgrammar's token bitmask layout: bit i % 32 of int32 word i // 32 stands for token i (1 = allowed).

Written here rather than asked of xgrammar, whose import (it brings Transformers) would otherwise be paid by
every engine at start, constrained or not."""

from __future__ import annotations

import numpy as np
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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf to the logits of `rows` where their bitmask row forbids the token (bitmask: a row per logits
    row; the others' rows may be overwritten)."""
    if logits.device.type == "cpu":
        _apply_on_cpu(logits, bitmask, rows)
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def _apply_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar's CPU kernel tests tokens one at a time; numpy unpacks the forbidden bits of all the rows at
    once, and one masked_fill_ applies them: several times faster."""
    if len(rows) < len(bitmask):
        unmasked = torch.ones(len(bitmask), dtype=torch.bool)
        unmasked[rows] = False
        bitmask[unmasked] = -1  # every bit set: all allowed
    # Little-endian int32 words as bytes, each unpacked least significant bit first: token order.
    forbidden = np.unpackbits(
        (~bitmask).numpy().view(np.uint8), axis=1, count=logits.shape[1], bitorder="little"
    )
    logits.masked_fill_(torch.from_numpy(forbidden.view(np.bool_)), float("-inf"))
