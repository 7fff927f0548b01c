"""The host-memory KV tier's bookkeeping: which host blocks hold KV the device had to let go, and the block
copies the next step must make before it runs (the model runner holds the memory and makes them).

It holds two kinds of KV:
- A preempted request's computed blocks, copied here instead of being dropped and copied back into fresh
  device blocks when it resumes, so it does not compute its prefix again.
- Prefix-cache blocks the device evicts, under their block hashes, so a conversation's history survives
  device-cache pressure: a later request whose prefix continues past the device's hits loads the rest
  from here.

The tier is bounded. A full tier first forgets its least recently used prefix blocks, then drops the saves
made longest ago (those requests are recomputed when they resume); a prefix block never displaces a save.
A host block that a pending copy reads or writes is not reused before that copy is made.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.contract.block_hash import BlockHash
from kvfleet.runtime.kv_events.collector import KVEventSink, NullKVEventSink


@dataclass
class _SavedKV:
    host_block_ids: list[int]
    num_tokens: int


@dataclass
class TierCopies:
    """(source block, destination block) pairs: device to host first, then host to device."""

    to_host: list[tuple[int, int]] = field(default_factory=list)
    to_device: list[tuple[int, int]] = field(default_factory=list)


class HostKVTier:
    def __init__(self, num_blocks: int, events: KVEventSink | None = None) -> None:
        """`events`: told of each prefix block the tier takes and lets go of."""
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._events = events or NullKVEventSink()
        self._free: list[int] = list(range(num_blocks))
        # Insertion ordered: the oldest save is dropped first when the tier is full.
        self._saved: dict[str, _SavedKV] = {}
        # Evicted prefix-cache blocks by hash, least recently used first.
        self._prefix: OrderedDict[BlockHash, int] = OrderedDict()
        self._copies = TierCopies()
        # Host blocks the pending copies read or write, and those of them already given up: free once the
        # copies are made.
        self._busy: set[int] = set()
        self._free_after_copies: list[int] = []
        self.blocks_offloaded = 0
        self.blocks_reloaded = 0
        # Preempted requests that resumed from the tier, and those that had to recompute instead.
        self.resumed_from_host = 0
        self.resumed_by_recompute = 0
        # Prefix-cache blocks evicted from the device and kept here, and those loaded back for a request.
        self.prefix_blocks_spilled = 0
        self.prefix_blocks_loaded = 0

    # Preempted requests.

    def save(self, request_id: str, device_block_ids: list[int], num_tokens: int) -> bool:
        """Copy a preempted request's first num_tokens tokens (in device_block_ids) to the tier, dropping the
        oldest saves if it is full. False, saving nothing, when the request alone is larger than the tier."""
        needed = len(device_block_ids)
        reclaimable = len(self._free) + sum(1 for block in self._prefix.values() if block not in self._busy)
        reclaimable += sum(
            1 for saved in self._saved.values() for block in saved.host_block_ids if block not in self._busy
        )
        if needed > reclaimable:
            return False
        while len(self._free) < needed:
            if not self._forget_least_recent_prefix():
                self._release(next(iter(self._saved)))
        host_block_ids = [self._take_free() for _ in range(needed)]
        self._copies.to_host.extend(zip(device_block_ids, host_block_ids, strict=True))
        self._saved[request_id] = _SavedKV(host_block_ids, num_tokens)
        self.blocks_offloaded += needed
        return True

    def saved_tokens(self, request_id: str) -> int:
        saved = self._saved.get(request_id)
        return 0 if saved is None else saved.num_tokens

    def restore(self, request_id: str, device_block_ids: list[int]) -> None:
        """Copy the request's saved KV into device_block_ids (one per saved block) and forget it."""
        saved = self._saved.pop(request_id)
        self._copies.to_device.extend(zip(saved.host_block_ids, device_block_ids, strict=True))
        self._busy.update(saved.host_block_ids)
        self._free_after_copies.extend(saved.host_block_ids)
        self.blocks_reloaded += len(saved.host_block_ids)
        self.resumed_from_host += 1

    def resume_by_recompute(self, request_id: str) -> None:
        """A preempted request resumes without its saved KV (dropped, or the prefix cache holds more)."""
        self.discard(request_id)
        self.resumed_by_recompute += 1

    def discard(self, request_id: str) -> None:
        """Forget a request's saved KV, if any (it finished while preempted, or resumes another way)."""
        if request_id in self._saved:
            self._release(request_id)

    # Evicted prefix-cache blocks.

    def spill(self, device_block_id: int, block_hash: BlockHash) -> None:
        """Keep a prefix-cache block the device is evicting (its KV is still intact until this step's copies
        are made). Skipped when the tier holds only saves and blocks in use."""
        if block_hash in self._prefix:
            self._prefix.move_to_end(block_hash)
            return
        if not self._free and not self._forget_least_recent_prefix():
            return
        host_block_id = self._take_free()
        self._copies.to_host.append((device_block_id, host_block_id))
        self._prefix[block_hash] = host_block_id
        self._events.spilled(block_hash)
        self.blocks_offloaded += 1
        self.prefix_blocks_spilled += 1

    def claim_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of block_hashes, from the first, the tier holds. Those stay until this step's copies are
        made, whatever the step spills meanwhile, so that load_prefix finds them."""
        count = 0
        for block_hash in block_hashes:
            host_block_id = self._prefix.get(block_hash)
            if host_block_id is None:
                break
            self._prefix.move_to_end(block_hash)
            self._busy.add(host_block_id)
            count += 1
        return count

    def load_prefix(self, block_hashes: Sequence[BlockHash], device_block_ids: Sequence[int]) -> None:
        """Copy the blocks of block_hashes (all held) into device_block_ids; the tier keeps them too."""
        for block_hash, device_block_id in zip(block_hashes, device_block_ids, strict=True):
            self._prefix.move_to_end(block_hash)
            host_block_id = self._prefix[block_hash]
            self._copies.to_device.append((host_block_id, device_block_id))
            self._busy.add(host_block_id)
        self.blocks_reloaded += len(block_hashes)
        self.prefix_blocks_loaded += len(block_hashes)

    def reset_prefixes(self) -> None:
        """Forget every prefix block (the device's prefix cache was reset: some KV may be unwritten)."""
        for host_block_id in self._prefix.values():
            self._give_up(host_block_id)
        self._prefix.clear()

    def take_copies(self) -> TierCopies:
        """The copies this step must make before its forward pass; the tier forgets them."""
        copies, self._copies = self._copies, TierCopies()
        self._free.extend(self._free_after_copies)
        self._free_after_copies = []
        self._busy.clear()
        return copies

    def _take_free(self) -> int:
        host_block_id = self._free.pop()
        self._busy.add(host_block_id)
        return host_block_id

    def _forget_least_recent_prefix(self) -> bool:
        """Frees the least recently used prefix block that no pending copy uses; False when there is none."""
        for block_hash, host_block_id in self._prefix.items():
            if host_block_id not in self._busy:
                del self._prefix[block_hash]
                self._free.append(host_block_id)
                self._events.dropped_from_host(block_hash)
                return True
        return False

    def _release(self, request_id: str) -> None:
        for host_block_id in self._saved.pop(request_id).host_block_ids:
            self._give_up(host_block_id)

    def _give_up(self, host_block_id: int) -> None:
        if host_block_id in self._busy:
            self._free_after_copies.append(host_block_id)
        else:
            self._free.append(host_block_id)
