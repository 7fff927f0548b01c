"""The KV cache's physical blocks: reference counts, a free queue in eviction order, and the prefix cache.

A freed block keeps its hash and stays findable until it is popped from the free queue for reuse, so a
finished request's prefix serves later requests for as long as memory allows (LRU by the time of freeing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from kvfleet.contract.block_hash import BlockHash
from kvfleet.runtime.kv_events.collector import KVEventSink, NullKVEventSink
from kvfleet.runtime.lora.request import LoRARequest


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves: O(1) pop, append and
    removal from the middle (a prefix-cache hit on a free block)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Sentinels remove every empty/edge special case from the link updates.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block to pop")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        on_evict: Callable[[int, BlockHash], None] | None = None,
        events: KVEventSink | None = None,
    ) -> None:
        """`on_evict(block_id, block_hash)`: told of each cached block about to be reused, while its KV is
        still intact (the host tier keeps a copy). `events`: told of each block registered and evicted."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash: a second block computed with the same content is simply not registered.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._on_evict = on_evict
        self._events = events or NullKVEventSink()

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks blocks from the head of the free queue (evicting their cached hashes), each with
        ref_cnt 1. Raises ValueError, taking nothing, when fewer are free."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks; only {queue.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it out of the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero go to the tail of the free queue in the
        given order (first = evicted first), keeping their hashes."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        *,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None,
    ) -> None:
        """Register blocks[i] under block_hashes[i], consecutive blocks of one request (computed with the
        adapter `lora`) whose tokens are `token_ids` and whose first block follows `parent`. A hash that
        another block already holds is left to that block, so the duplicate is recycled as a plain block when
        freed."""
        if not self.enable_caching:
            return
        cache = self.cached_block_hash_to_block
        block_size = len(token_ids) // len(blocks) if blocks else 0
        run_start = 0
        for index, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block_hash in cache:
                self._report_stored(block_hashes, run_start, index, parent, token_ids, block_size, lora)
                run_start = index + 1
                continue
            block.block_hash = block_hash
            cache[block_hash] = block
        self._report_stored(block_hashes, run_start, len(blocks), parent, token_ids, block_size, lora)

    def _report_stored(
        self,
        block_hashes: Sequence[BlockHash],
        start: int,
        stop: int,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: LoRARequest | None,
    ) -> None:
        """One event for the run of newly registered blocks [start, stop)."""
        if start < stop:
            run_parent = block_hashes[start - 1] if start else parent
            run_tokens = token_ids[start * block_size : stop * block_size]
            self._events.stored(block_hashes[start:stop], run_parent, run_tokens, lora)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use keep their contents and are recycled when freed."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached_block_hash_to_block[block.block_hash]
        self._events.evicted(block.block_hash)
        if self._on_evict is not None:
            self._on_evict(block.block_id, block.block_hash)
        block.block_hash = None
