"""Prefix-cache block hashes: the one rule by which an engine names the KV blocks it caches and publishes,
and by which a router finds a prompt's blocks among those a replica published.

A prompt's full blocks are hashed in a chain, each block's hash over its parent's hash, its token ids and
the extra keys that make its KV differ from another block's with the same tokens (the content hashes of the
images or audio clips whose placeholder tokens it holds: the same placeholders stand for any image). Equal
hashes therefore mean equal whole prefixes. A chain starts from a seed that holds what changes every block's
KV at once: the LoRA adapter (by its `lora_int_id`, a digest of its files, so that every replica that loads
the same files agrees and an adapter replaced on disk never meets its old KV; a router learns each
replica's id for an adapter name from the replica's metrics), the request's `cache_salt` (a tenant's salt
keeps its prefix cache apart from everyone else's) and what the model itself makes the KV depend on
besides tokens (a long prompt's rope scaling).

SHA-256 rather than Python's hash(): a collision would hand one request another's KV, and an unkeyed hash is
cheap to collide on purpose. Published events carry the last 8 bytes of each hash as an unsigned integer,
the form vLLM publishes (`external_block_hash`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol

BlockHash = bytes


class MediaSpan(Protocol):
    """An image or audio clip of a prompt: the placeholder tokens [offset, end) and its content hash."""

    @property
    def offset(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def identifier(self) -> bytes: ...


def chain_seed(
    lora_int_id: int = 0, cache_salt: str | None = None, model_salt: bytes | None = None
) -> BlockHash | None:
    """The hash a chain starts from; None (no parent) for the base model's unsalted prompts. `lora_int_id`
    0 is the base model."""
    if not lora_int_id and cache_salt is None and model_salt is None:
        return None
    hasher = hashlib.sha256(b"kvfleet-chain")
    lora = str(lora_int_id).encode() if lora_int_id else None
    for tag, value in ((b"lora", lora), (b"salt", cache_salt), (b"model", model_salt)):
        if value is not None:
            data = value.encode() if isinstance(value, str) else value
            # Length-prefixed, so that no two different key sets feed the hasher the same bytes.
            hasher.update(tag + len(data).to_bytes(8, "big") + data)
    return hasher.digest()


def hash_block_tokens(
    parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    hasher = hashlib.sha256(parent_block_hash or b"")
    tokens = array("q", token_ids)
    if sys.byteorder != "little":
        # The same bytes on every machine: a router and an engine may run on different architectures.
        tokens.byteswap()
    hasher.update(tokens.tobytes())
    hasher.update(extra_keys)
    return hasher.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash | None,
    media: Sequence[MediaSpan] = (),
    *,
    start_block: int = 0,
    stop_block: int | None = None,
) -> Iterator[BlockHash]:
    """The hashes of the full blocks of `token_ids` from block `start_block` up to `stop_block` (all full
    blocks by default); `parent` is the hash of block start_block - 1, or the chain's seed at block 0."""
    end_block = len(token_ids) // block_size
    if stop_block is not None:
        end_block = min(stop_block, end_block)
    for index in range(start_block, end_block):
        first, end = index * block_size, (index + 1) * block_size
        extra_keys = b"".join(item.identifier for item in media if item.offset < end and item.end > first)
        parent = hash_block_tokens(parent, token_ids[first:end], extra_keys)
        yield parent


def external_block_hash(block_hash: BlockHash) -> int:
    """A block hash as KV events carry it: its last 8 bytes, an unsigned big-endian integer."""
    return int.from_bytes(block_hash[-8:], "big")
