"""Which replica holds which prefix-cache block, on which medium: the `precise-prefix` policy's picture of
the fleet's KV caches, built from the replicas' own KV events (kvfleet.gateway.kv_events).

Blocks are named by the 64-bit hashes the events carry (kvfleet.contract.block_hash.external_block_hash).
A block can be held on the device and in the host tier at once (a spill copies it), so an entry is one
(replica, block, medium). The index is bounded: past `max_entries` it forgets the entries stored least
recently, over all replicas together. Recency is that of the events only, never of lookups, so that two
gateway replicas fed the same events hold the same index and route alike. An entry costs about
ENTRY_BYTES of memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvfleet.contract.kv_events import MEDIUM_DEVICE

# The tiers a replica holds a block in, as bits.
DEVICE, HOST = 1, 2
Tier = int
# Measured with tracemalloc over a million entries of 16 replicas (CPython 3.11): the ordered entry, its key
# and the replica's own mapping of the block.
ENTRY_BYTES = 240
# About 240 MB: the device caches of some sixty replicas that each hold 250,000 tokens in blocks of 16.
DEFAULT_MAX_ENTRIES = 1_000_000


def tier_of(medium: str | None) -> Tier:
    """The events' medium as the index weighs it: the engine's own cache (vLLM's "GPU", in any case, which
    publishers that predate the field leave unset) or a slower tier (the host tier, "CPU", or any other)."""
    return DEVICE if medium is None or medium.upper() == MEDIUM_DEVICE else HOST


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a prompt's start a replica holds: the leading blocks it holds on its device, then those
    it holds only in a slower tier."""

    device_blocks: int = 0
    host_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks


class KVBlockIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("the KV block index holds one entry at least")
        self.max_entries = max_entries
        # (replica, block hash, tier), least recently stored first.
        self._entries: OrderedDict[tuple[str, int, Tier], None] = OrderedDict()
        # Replica -> block hash -> the tiers holding it (bits).
        self._held: dict[str, dict[int, int]] = {}
        # Replica -> the block size of its last stored blocks: the prompt is hashed in blocks of that size.
        self._block_size: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, replica: str, block_hashes: Iterable[int], medium: str | None, block_size: int) -> None:
        tier = tier_of(medium)
        held = self._held.setdefault(replica, {})
        self._block_size[replica] = block_size
        for block in block_hashes:
            key = (replica, block, tier)
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._entries[key] = None
            held[block] = held.get(block, 0) | tier
        while len(self._entries) > self.max_entries:
            (old_replica, old_block, old_tier), _ = self._entries.popitem(last=False)
            self._forget(old_replica, old_block, old_tier)

    def remove(self, replica: str, block_hashes: Iterable[int], medium: str | None) -> None:
        tier = tier_of(medium)
        for block in block_hashes:
            key = (replica, block, tier)
            if key in self._entries:
                del self._entries[key]
                self._forget(replica, block, tier)

    def drop(self, replica: str) -> int:
        """Forgets every entry of the replica, in time proportional to their number; returns how many."""
        held = self._held.pop(replica, {})
        self._block_size.pop(replica, None)
        dropped = 0
        for block, tiers in held.items():
            for tier in (DEVICE, HOST):
                if tiers & tier:
                    del self._entries[(replica, block, tier)]
                    dropped += 1
        return dropped

    def block_size(self, replica: str) -> int | None:
        """The block size of the replica's cached blocks; None before it has stored any."""
        return self._block_size.get(replica)

    def match(self, replica: str, block_hashes: Sequence[int]) -> PrefixMatch:
        """The replica's longest run of the prompt's blocks from its start. A block the device holds counts
        there; the run goes on through blocks only the host tier holds, and ends at the first it lacks."""
        held = self._held.get(replica)
        if not held:
            return PrefixMatch()
        device = host = 0
        for block in block_hashes:
            tiers = held.get(block)
            if not tiers:
                break
            if tiers & DEVICE:
                device += 1
            else:
                host += 1
        return PrefixMatch(device, host)

    def _forget(self, replica: str, block: int, tier: Tier) -> None:
        held = self._held[replica]
        tiers = held[block] & ~tier
        if tiers:
            held[block] = tiers
        else:
            del held[block]
