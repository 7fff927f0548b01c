"""The host-memory KV tier's bookkeeping: which host blocks hold a preempted request's KV, and the block
copies the next step must make before it runs (the model runner holds the memory and makes them).

A preempted request's computed blocks are copied to host blocks instead of being dropped, and copied back
into fresh device blocks when it resumes, so it does not compute its prefix again. The tier is bounded:
saving into a full tier drops the KV saved longest ago, and that request is recomputed when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))
        # Insertion ordered: the oldest save is dropped first when the tier is full.
        self._saved: dict[str, _SavedKV] = {}
        self._copies = TierCopies()
        # Host blocks whose KV goes back to the device in the pending copies: free once they are taken.
        self._freed_after_copies: list[int] = []
        self.blocks_offloaded = 0
        self.blocks_reloaded = 0
        # Preempted requests that resumed from the tier, and those that had to recompute instead.
        self.resumed_from_host = 0
        self.resumed_by_recompute = 0

    def save(self, request_id: str, device_block_ids: list[int], num_tokens: int) -> bool:
        """Copy a preempted request's first num_tokens tokens (in device_block_ids) to the tier, dropping the
        oldest saves if it is full. False, saving nothing, when the request alone is larger than the tier."""
        needed = len(device_block_ids)
        if needed > self.num_blocks - len(self._freed_after_copies):
            return False
        while len(self._free) < needed:
            self._release(next(iter(self._saved)))
        host_block_ids = [self._free.pop() for _ in range(needed)]
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
        self._freed_after_copies.extend(saved.host_block_ids)
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

    def take_copies(self) -> TierCopies:
        """The copies this step must make before its forward pass; the tier forgets them."""
        copies, self._copies = self._copies, TierCopies()
        self._free.extend(self._freed_after_copies)
        self._freed_after_copies = []
        return copies

    def _release(self, request_id: str) -> None:
        self._free.extend(self._saved.pop(request_id).host_block_ids)
