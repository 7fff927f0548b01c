"""A request's prefix-caching block hashes, by the rule of kvfleet.contract.block_hash."""

from __future__ import annotations

from kvfleet.contract.block_hash import BlockHash, block_hashes, chain_seed
from kvfleet.runtime.request import Request


def extend_block_hashes(request: Request, block_size: int, num_full_blocks: int) -> list[BlockHash]:
    """Make request.block_hashes cover its first num_full_blocks blocks, hashing only the missing ones."""
    hashes = request.block_hashes
    start = len(hashes)
    if start >= num_full_blocks:
        return hashes
    tokens = request.all_token_ids
    if num_full_blocks * block_size > len(tokens):
        raise ValueError(
            f"request {request.request_id!r} has {len(tokens)} tokens: not {num_full_blocks} full blocks"
        )
    parent = (
        hashes[-1]
        if hashes
        else chain_seed(request.lora_int_id, cache_salt=request.cache_salt, model_salt=request.model_salt)
    )
    new_hashes = block_hashes(
        tokens, block_size, parent, request.mm_features, start_block=start, stop_block=num_full_blocks
    )
    hashes.extend(new_hashes)
    return hashes
