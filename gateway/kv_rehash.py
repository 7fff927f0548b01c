"""Blocks of a replica whose engine hashes them by a rule of its own (vLLM), keyed by kvfleet's rule instead.

The gateway finds a prompt's blocks by hashing it with kvfleet's rule (kvfleet.contract.block_hash), which a
kvfleet replica's events already carry. vLLM's events carry vLLM's hashes, which the gateway cannot compute,
but also each block's tokens and its parent: so each stored block is hashed again by kvfleet's rule, chained
through its parent's new hash, and the index holds that. A block whose KV depends on more than its tokens
(an adapter, an image, a `cache_salt`: vLLM names them in `lora_name` and `extra_keys`) cannot be keyed
that way, and is left out with the blocks that follow it, as is a block whose parent is unknown here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvfleet.contract.block_hash import BlockHash, external_block_hash, hash_block_tokens
from kvfleet.runtime.kv_events.wire import BlockStored


class TokenRehasher:
    def __init__(self, max_entries: int) -> None:
        """`max_entries`: the engine hashes remembered at most (the least recently stored forgotten)."""
        self._max_entries = max_entries
        # The replica's hash of a block -> kvfleet's hash of it, least recently stored first.
        self._keys: OrderedDict[int, BlockHash] = OrderedDict()

    def stored(self, event: BlockStored) -> list[int]:
        """kvfleet's hashes of the event's blocks, as far as they can be computed."""
        if event.lora_id or event.lora_name is not None:
            return []
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            parent = self._keys.get(event.parent_block_hash)
            if parent is None:
                return []
        extra_keys = event.extra_keys or []
        size = event.block_size
        hashes = []
        for index, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size : (index + 1) * size]
            if len(tokens) != size or (index < len(extra_keys) and extra_keys[index] is not None):
                break
            parent = hash_block_tokens(parent, tokens)
            self._keys[engine_hash] = parent
            self._keys.move_to_end(engine_hash)
            hashes.append(external_block_hash(parent))
        while len(self._keys) > self._max_entries:
            self._keys.popitem(last=False)
        return hashes

    def removed(self, engine_hashes: Iterable[int]) -> list[int]:
        """kvfleet's hashes of the blocks the replica removed from a medium. The keys stay: the block may
        still be held on another medium, and its children still name it."""
        return [external_block_hash(key) for h in engine_hashes if (key := self._keys.get(h)) is not None]

    def clear(self) -> None:
        self._keys.clear()
