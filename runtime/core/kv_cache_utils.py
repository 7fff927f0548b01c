"""Prefix-caching block hashes: a chain over full blocks, so equal hashes mean equal whole prefixes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvfleet.runtime.request import Request

# A SHA-256 digest rather than Python's hash(): a collision would hand one request another's KV cache, and
# int-tuple hashes are unkeyed and cheap to collide on purpose.
BlockHash = bytes


def hash_block_tokens(
    parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """`extra_keys`: what else decides the block's KV besides its tokens (the content hashes of the items
    whose placeholders it holds: the same placeholder tokens stand for any image or audio clip)."""
    hasher = hashlib.sha256(parent_block_hash or b"")
    hasher.update(array("q", token_ids).tobytes())
    hasher.update(extra_keys)
    return hasher.digest()


def _chain_start(request: Request) -> BlockHash | None:
    # An adapter's KV differs from the base model's for the same tokens, and so does KV salted by the model
    # (see Request.cache_salt): such chains start from their own seed.
    if not request.lora_int_id and request.cache_salt is None:
        return None
    hasher = hashlib.sha256(b"lora:%d" % request.lora_int_id)
    if request.cache_salt is not None:
        hasher.update(b"salt:" + request.cache_salt)
    return hasher.digest()


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
    parent = hashes[-1] if hashes else _chain_start(request)
    features = request.mm_features
    for index in range(start, num_full_blocks):
        first, end = index * block_size, (index + 1) * block_size
        extra_keys = b"".join(f.identifier for f in features if f.offset < end and f.end > first)
        parent = hash_block_tokens(parent, tokens[first:end], extra_keys)
        hashes.append(parent)
    return hashes
