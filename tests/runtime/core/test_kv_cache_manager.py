from __future__ import annotations

import pytest
from kvfleet.contract import block_hash
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams

BLOCK = 4


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def admit(manager: KVCacheManager, req: Request) -> int:
    """Allocate a waiting request's whole prompt after its prefix hits, as the scheduler does."""
    blocks, num_cached = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_cached, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return num_cached


def test_allocates_whole_blocks_as_tokens_grow() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    req = request("a", list(range(6)))
    new_blocks = manager.allocate_slots(req, 6)
    assert [block.block_id for block in new_blocks] == [0, 1]
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 2) == []  # fits in block 1
    req.num_computed_tokens = 8
    assert [block.block_id for block in manager.allocate_slots(req, 1)] == [2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)


def test_prefix_hit_is_whole_blocks_only() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    shared = list(range(100, 109))  # two full blocks and one token
    first = request("first", [*shared, 1, 2])
    assert admit(manager, first) == 0
    second = request("second", [*shared, 3, 4, 5])
    blocks, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 8
    assert [block.block_id for block in blocks] == manager.get_block_ids("first")[:2]


def test_never_the_whole_prompt() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    prompt = list(range(8))
    admit(manager, request("first", prompt))
    blocks, num_cached = manager.get_computed_blocks(request("again", prompt))
    assert num_cached == 4  # the last block is recomputed so that its last token gives logits
    assert len(blocks) == 1
    blocks, num_cached = manager.get_computed_blocks(request("longer", [*prompt, 9]))
    assert num_cached == 8


def test_equal_block_after_a_different_prefix_is_a_miss() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    admit(manager, request("first", [1, 1, 1, 1, 7, 7, 7, 7, 0]))
    assert manager.get_computed_blocks(request("other", [2, 2, 2, 2, 7, 7, 7, 7, 0]))[1] == 0


def test_hit_survives_free_until_evicted() -> None:
    manager = KVCacheManager(4, BLOCK, enable_caching=True)
    first = request("first", list(range(9)))
    admit(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = request("again", list(range(9)))
    assert admit(manager, again) == 8
    assert manager.get_block_ids("again")[:2] == [0, 1]
    assert manager.prefix_cache_queries == 18
    assert manager.prefix_cache_hits == 8


def test_free_releases_the_tail_block_first() -> None:
    manager = KVCacheManager(5, BLOCK, enable_caching=True)
    req = request("a", list(range(12)))
    admit(manager, req)
    manager.free(req)
    assert [block.block_id for block in manager.block_pool.free_block_queue] == [3, 4, 2, 1, 0]
    with pytest.raises(KeyError):
        manager.get_block_ids("a")
    manager.free(req)  # freeing twice is harmless


def test_failed_allocation_changes_nothing() -> None:
    manager = KVCacheManager(4, BLOCK, enable_caching=True)
    cached = request("cached", list(range(9)))
    admit(manager, cached)
    manager.free(cached)
    holder = request("holder", [50, 51, 52, 53])
    admit(manager, holder)  # takes block 3, the one free block that held nothing
    queue_before = [block.block_id for block in manager.block_pool.free_block_queue]
    counters_before = (manager.prefix_cache_queries, manager.prefix_cache_hits)

    # Two hits on free blocks plus three new blocks: the hits cannot also count as free space.
    big = request("big", list(range(8)) + list(range(200, 212)))
    blocks, num_cached = manager.get_computed_blocks(big)
    assert num_cached == 8
    assert manager.allocate_slots(big, big.num_tokens - num_cached, blocks) is None

    assert [block.block_id for block in manager.block_pool.free_block_queue] == queue_before
    assert all(block.ref_cnt == 0 for block in blocks)
    assert "big" not in manager.req_to_blocks
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == counters_before
    assert manager.block_pool.get_cached_block(big.block_hashes[0]) is blocks[0]


def test_counters_count_each_admission_once() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    admit(manager, request("a", list(range(10))))
    late = request("b", list(range(10)))
    for _ in range(3):  # a blocked request is looked up again every step
        manager.get_computed_blocks(late)
    admit(manager, late)
    assert manager.prefix_cache_queries == 20
    assert manager.prefix_cache_hits == 8


def test_caching_disabled() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=False)
    admit(manager, request("a", list(range(10))))
    assert manager.get_computed_blocks(request("b", list(range(10)))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


def test_hashes_only_newly_full_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real_hash = block_hash.hash_block_tokens

    def counting_hash(parent: bytes | None, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
        calls.append(tuple(token_ids))
        return real_hash(parent, token_ids, extra_keys)

    monkeypatch.setattr(block_hash, "hash_block_tokens", counting_hash)
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    req = request("a", list(range(6)))
    admit(manager, req)
    assert calls == [(0, 1, 2, 3)]
    for token in (6, 7, 8):  # decode: block 1 becomes full after token 7 has run
        req.append_output_token_ids(token)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert len(req.block_hashes) == 2
    assert manager.block_pool.get_cached_block(req.block_hashes[1]).block_id == manager.get_block_ids("a")[1]


def test_delayed_caching_waits_for_cache_blocks() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    req = request("a", list(range(9)))
    assert manager.allocate_slots(req, 9, delay_cache_blocks=True) is not None
    assert manager.block_pool.cached_block_hash_to_block == {}
    manager.cache_blocks(req, 9)
    assert len(manager.block_pool.cached_block_hash_to_block) == 2


def test_rejects_misuse() -> None:
    manager = KVCacheManager(10, BLOCK, enable_caching=True)
    first = request("a", list(range(9)))
    admit(manager, first)
    with pytest.raises(ValueError, match="positive"):
        manager.allocate_slots(first, 0)
    hits, _ = manager.get_computed_blocks(request("b", list(range(9))))
    with pytest.raises(ValueError, match="first allocation"):
        manager.allocate_slots(first, 1, hits)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0, enable_caching=True)
