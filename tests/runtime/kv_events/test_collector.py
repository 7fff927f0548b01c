"""The events the block pool and the host tier report, checked against what they do: a run of blocks split
where another block already holds a hash, evictions that spill and drop, a save that pushes prefix blocks
out of the tier, and a reset."""

from __future__ import annotations

from kvfleet.contract.block_hash import external_block_hash
from kvfleet.runtime.core.block_pool import BlockPool
from kvfleet.runtime.core.host_kv_tier import HostKVTier
from kvfleet.runtime.kv_events.collector import KVEventCollector
from kvfleet.runtime.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvfleet.runtime.lora.request import LoRARequest

BLOCK_SIZE = 2
ADAPTER = LoRARequest("tenant-x", 9, "/adapters/x")


def _x(*hashes: bytes) -> list[int]:
    return [external_block_hash(h) for h in hashes]


def _pool(num_blocks: int, collector: KVEventCollector, tier: HostKVTier | None = None) -> BlockPool:
    on_evict = None if tier is None else tier.spill
    return BlockPool(num_blocks, enable_caching=True, on_evict=on_evict, events=collector)


def test_a_run_is_split_where_another_block_already_holds_a_hash() -> None:
    collector = KVEventCollector(BLOCK_SIZE, remembers_blocks=False)
    pool = _pool(6, collector)
    pool.cache_full_blocks(pool.get_new_blocks(1), [b"b"], parent=b"a", token_ids=[3, 4], lora=None)
    collector.take()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(
        blocks, [b"a", b"b", b"c"], parent=None, token_ids=[1, 2, 3, 4, 5, 6], lora=ADAPTER
    )
    assert collector.take() == [
        BlockStored(_x(b"a"), None, [1, 2], BLOCK_SIZE, 9, "GPU", "tenant-x"),
        BlockStored(_x(b"c"), external_block_hash(b"b"), [5, 6], BLOCK_SIZE, 9, "GPU", "tenant-x"),
    ]
    assert collector.take() == []


def test_evictions_spill_to_the_host_tier_with_what_was_stored_and_drop_from_it() -> None:
    collector = KVEventCollector(BLOCK_SIZE, remembers_blocks=True)
    tier = HostKVTier(1, collector)
    pool = _pool(2, collector, tier)
    first = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [b"a", b"b"], parent=None, token_ids=[1, 2, 3, 4], lora=ADAPTER)
    pool.free_blocks(first)
    collector.take()
    pool.get_new_blocks(1)  # evicts a, which the tier takes
    assert collector.take() == [
        BlockRemoved(_x(b"a"), "GPU"),
        BlockStored(_x(b"a"), None, [1, 2], BLOCK_SIZE, 9, "CPU", "tenant-x"),
    ]
    tier.take_copies()
    pool.get_new_blocks(1)  # evicts b, which pushes a out of the one-block tier
    assert collector.take() == [
        BlockRemoved(_x(b"b"), "GPU"),
        BlockRemoved(_x(b"a"), "CPU"),
        BlockStored(_x(b"b"), external_block_hash(b"a"), [3, 4], BLOCK_SIZE, 9, "CPU", "tenant-x"),
    ]
    tier.take_copies()
    # A preempted request's save takes the tier's last block: b goes.
    assert tier.save("r", [0], num_tokens=2)
    assert collector.take() == [BlockRemoved(_x(b"b"), "CPU")]


def test_evictions_in_a_row_share_one_event_and_a_reset_supersedes_the_step_s_events() -> None:
    collector = KVEventCollector(BLOCK_SIZE, remembers_blocks=False)
    pool = _pool(3, collector)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"a", b"b", b"c"], parent=None, token_ids=[1, 2, 3, 4, 5, 6], lora=None)
    pool.free_blocks(blocks)
    collector.take()
    pool.get_new_blocks(2)
    assert collector.take() == [BlockRemoved(_x(b"a", b"b"), "GPU")]
    pool.get_new_blocks(1)
    collector.cleared()
    assert collector.take() == [AllBlocksCleared()]
