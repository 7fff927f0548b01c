from __future__ import annotations

import pytest
from kvfleet.runtime.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def cache(pool: BlockPool, blocks: list[KVCacheBlock], block_hashes: list[bytes]) -> None:
    """Register blocks of one token each, at a chain's start."""
    pool.cache_full_blocks(blocks, block_hashes, parent=None, token_ids=[0] * len(blocks), lora=None)


def test_free_queue_starts_in_block_order_and_pops_from_the_head() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    blocks = pool.get_new_blocks(2)
    assert [block.block_id for block in blocks] == [0, 1]
    assert [block.ref_cnt for block in blocks] == [1, 1]
    assert free_ids(pool) == [2, 3, 4]
    assert pool.get_num_free_blocks() == 3
    assert pool.usage == pytest.approx(0.4)


def test_get_new_blocks_takes_nothing_when_too_few_are_free() -> None:
    pool = BlockPool(3, enable_caching=True)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [0, 1, 2]
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def test_free_blocks_go_to_the_tail_in_the_given_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[2], blocks[0]])
    assert free_ids(pool) == [3, 2, 0]
    assert [block.ref_cnt for block in blocks] == [0, 1, 0]
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([blocks[0]])


def test_shared_block_is_freed_only_by_its_last_holder() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [1]
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [1, 0]


def test_cached_block_keeps_its_hash_when_freed_and_is_evicted_only_when_reused() -> None:
    pool = BlockPool(3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    cache(pool, [first, second], [b"h0", b"h1"])
    pool.free_blocks([second, first])
    assert free_ids(pool) == [2, 1, 0]
    assert pool.get_cached_block(b"h0") is first
    assert pool.get_cached_block(b"h1") is second

    # Least recently freed first: block 2 was never cached, then block 1 (h1) goes.
    pool.get_new_blocks(1)
    assert pool.get_cached_block(b"h1") is second
    (reused,) = pool.get_new_blocks(1)
    assert reused is second
    assert reused.block_hash is None
    assert pool.get_cached_block(b"h1") is None
    assert pool.get_cached_block(b"h0") is first


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [b"a", b"b", b"c"])
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 0, 1, 2]
    pool.touch([pool.get_cached_block(b"b")])  # from the middle
    assert free_ids(pool) == [3, 0, 2]
    assert blocks[1].ref_cnt == 1
    assert blocks[1].block_hash == b"b"
    # The next allocations cannot evict it.
    taken = pool.get_new_blocks(3)
    assert blocks[1] not in taken
    assert pool.get_cached_block(b"b") is blocks[1]
    assert pool.get_cached_block(b"a") is None


def test_a_hash_already_cached_by_another_block_is_left_to_that_block() -> None:
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    cache(pool, [first], [b"same"])
    cache(pool, [second], [b"same"])
    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [b"x", b"y"])
    assert pool.get_cached_block(b"x") is None
    assert all(block.block_hash is None for block in blocks)


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [b"x", b"y"])
    pool.free_blocks(blocks[:1])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is None
    assert pool.get_cached_block(b"y") is None
    assert all(block.block_hash is None for block in pool.blocks)
    assert blocks[1].ref_cnt == 1
    assert free_ids(pool) == [2, 0]


def test_pool_needs_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_caching=True)


class TestFreeQueue:
    def test_remove_from_head_middle_and_tail(self) -> None:
        blocks = [KVCacheBlock(i) for i in range(5)]
        queue = FreeKVCacheBlockQueue(blocks)
        queue.remove(blocks[2])
        queue.remove(blocks[0])
        queue.remove(blocks[4])
        assert [block.block_id for block in queue] == [1, 3]
        assert len(queue) == 2
        queue.append(blocks[4])
        queue.append(blocks[0])
        assert [block.block_id for block in queue] == [1, 3, 4, 0]
        assert [queue.popleft().block_id for _ in range(4)] == [1, 3, 4, 0]
        assert len(queue) == 0

    def test_misuse_is_reported(self) -> None:
        blocks = [KVCacheBlock(i) for i in range(2)]
        queue = FreeKVCacheBlockQueue(blocks)
        with pytest.raises(ValueError, match="already in the free queue"):
            queue.append(blocks[0])
        queue.remove(blocks[0])
        with pytest.raises(ValueError, match="not in the free queue"):
            queue.remove(blocks[0])
        queue.popleft()
        with pytest.raises(ValueError, match="no free block"):
            queue.popleft()
