"""Each request's block table, prefix-cache lookups, and the slot arithmetic of one allocation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfleet.contract.block_hash import BlockHash
from kvfleet.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvfleet.runtime.core.kv_cache_utils import extend_block_hashes
from kvfleet.runtime.kv_events.collector import KVEventSink, NullKVEventSink
from kvfleet.runtime.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        sliding_window: int | None = None,
        on_evict: Callable[[int, BlockHash], None] | None = None,
        events: KVEventSink | None = None,
    ) -> None:
        """`sliding_window`: the model's attention window when every layer has one (the widest); a request's
        blocks that fall wholly before it then go back to the pool as the request grows. `on_evict` and
        `events`: see BlockPool."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.events = events or NullKVEventSink()
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict, self.events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Kept alongside req_to_blocks so a step's block tables cost nothing to hand to the model runner.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # How many of a request's leading blocks fell out of the sliding window and went back to the pool.
        # They keep their places in the block table, which attention never reads there.
        self.num_released_blocks: dict[str, int] = {}
        # In tokens, counted once per admission (not per scheduling attempt).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of a request that holds no blocks yet, and the
        number of tokens they cover. Never the whole request: its last token must run to give logits."""
        if not self.enable_caching:
            return [], 0
        block_size = self.block_size
        num_tokens = request.num_tokens
        block_hashes = extend_block_hashes(request, block_size, num_tokens // block_size)
        lookup = self.block_pool.cached_block_hash_to_block.get
        computed_blocks: list[KVCacheBlock] = []
        for index in range((num_tokens - 1) // block_size):
            block = lookup(block_hashes[index])
            if block is None:
                break
            computed_blocks.append(block)
        return computed_blocks, len(computed_blocks) * block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        *,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the request's computed ones (and after
        new_computed_blocks, the prefix-cache hits of a first allocation). Returns the newly allocated blocks,
        or None, changing nothing, when too few blocks are free.

        Full blocks are registered in the prefix cache at once, as vLLM does: the step that computes them
        runs before any later step can read them, and a request admitted later in the same step sits later
        in the batch, after its KV is written. delay_cache_blocks leaves that to cache_blocks()."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        block_size = self.block_size
        pool = self.block_pool
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            hits: Sequence[KVCacheBlock] = new_computed_blocks or ()
            num_tokens_after = len(hits) * block_size + num_new_tokens
            num_required = -(-num_tokens_after // block_size) - len(hits)
            # Hits on free blocks leave the free queue when touched, so they cannot also serve as new blocks.
            num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
            if num_required > pool.get_num_free_blocks() - num_free_hits:
                return None
            pool.touch(hits)
            blocks = self.req_to_blocks[request_id] = list(hits)
            self.req_to_block_ids[request_id] = [block.block_id for block in hits]
            if self.enable_caching:
                self.num_cached_blocks[request_id] = len(hits)
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hits) * block_size
        else:
            if new_computed_blocks:
                raise ValueError(
                    f"request {request_id!r} already holds blocks; prefix hits apply to a first allocation"
                )
            if self.sliding_window is not None:
                self._release_blocks_before_window(request, blocks)
            num_tokens_after = request.num_computed_tokens + num_new_tokens
            num_required = -(-num_tokens_after // block_size) - len(blocks)
            if num_required > pool.get_num_free_blocks():
                return None
        if num_required > 0:
            new_blocks = pool.get_new_blocks(num_required)
            blocks.extend(new_blocks)
            self.req_to_block_ids[request_id].extend(block.block_id for block in new_blocks)
        else:  # the usual decode step: the last block still has room
            new_blocks = []
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, num_tokens_after)
        return new_blocks

    def _release_blocks_before_window(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Free the blocks wholly before the window of the request's next token: no later token sees them.
        They stay in the prefix cache until evicted, so a prefix hit on them is still a whole prefix."""
        assert self.sliding_window is not None
        request_id = request.request_id
        first_visible = max(0, request.num_computed_tokens - self.sliding_window + 1)
        first_kept = first_visible // self.block_size
        if self.enable_caching:
            first_kept = min(first_kept, self.num_cached_blocks[request_id])  # registered before freed
        released = self.num_released_blocks.get(request_id, 0)
        if first_kept > released:
            self.block_pool.free_blocks(reversed(blocks[released:first_kept]))
            self.num_released_blocks[request_id] = first_kept

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once its first num_computed_tokens tokens have run."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        block_size = self.block_size
        num_full_blocks = min(num_computed_tokens, request.num_tokens) // block_size
        num_cached = self.num_cached_blocks[request_id]
        if num_full_blocks <= num_cached:
            return
        block_hashes = extend_block_hashes(request, block_size, num_full_blocks)
        blocks = self.req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(
            blocks[num_cached:num_full_blocks],
            block_hashes[num_cached:num_full_blocks],
            parent=block_hashes[num_cached - 1] if num_cached else None,
            token_ids=request.all_token_ids[num_cached * block_size : num_full_blocks * block_size],
            lora=request.lora_request,
        )
        self.num_cached_blocks[request_id] = num_full_blocks

    def free_blocks_past(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks that hold none of its first num_tokens tokens (the KV slots of
        rejected draft tokens). Those blocks were never registered in the prefix cache."""
        request_id = request.request_id
        blocks = self.req_to_blocks[request_id]
        num_kept = -(-num_tokens // self.block_size)
        if num_kept >= len(blocks):
            return
        surplus = blocks[num_kept:]
        del blocks[num_kept:]
        del self.req_to_block_ids[request_id][num_kept:]
        self.block_pool.free_blocks(reversed(surplus))

    def free(self, request: Request) -> None:
        """Release every block of the request; cached ones stay findable until reused."""
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return
        del self.req_to_block_ids[request_id]
        self.num_cached_blocks.pop(request_id, None)
        released = self.num_released_blocks.pop(request_id, 0)
        # Last blocks first: a prompt's tail is the part least likely to be shared, so it is evicted first.
        self.block_pool.free_blocks(reversed(blocks[released:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table. Within a step the list is only ever appended to (rejected drafts'
        blocks leave it after the step ran), so callers may keep it for the step but must not change it."""
        return self.req_to_block_ids[request_id]

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
