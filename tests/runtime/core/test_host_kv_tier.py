"""HostKVTier's bookkeeping: which host blocks a save takes, what a full tier drops, when blocks free."""

from __future__ import annotations

import pytest
from kvfleet.runtime.core.host_kv_tier import HostKVTier


def test_save_and_restore_copy_block_for_block() -> None:
    tier = HostKVTier(4)
    assert tier.save("a", [7, 3], num_tokens=12)
    copies = tier.take_copies()
    assert [device for device, _ in copies.to_host] == [7, 3]
    host_blocks = [host for _, host in copies.to_host]
    assert tier.saved_tokens("a") == 12
    tier.restore("a", [5, 9])
    assert tier.take_copies().to_device == list(zip(host_blocks, [5, 9], strict=True))
    assert (tier.saved_tokens("a"), tier.blocks_offloaded, tier.blocks_reloaded) == (0, 2, 2)


def test_a_full_tier_drops_the_oldest_save() -> None:
    tier = HostKVTier(4)
    tier.save("old", [1, 2], num_tokens=16)
    tier.save("newer", [3], num_tokens=8)
    assert tier.save("new", [4, 5], num_tokens=10)
    assert (tier.saved_tokens("old"), tier.saved_tokens("newer"), tier.saved_tokens("new")) == (0, 8, 10)
    assert not tier.save("huge", [1, 2, 3, 4, 5], num_tokens=40)
    assert tier.saved_tokens("newer") == 8  # a save that cannot fit drops nothing


def test_restored_blocks_stay_taken_until_the_copies_are_made() -> None:
    tier = HostKVTier(2)
    tier.save("a", [1, 2], num_tokens=16)
    tier.take_copies()
    tier.restore("a", [3, 4])
    # Their KV still has to travel back this step: another save must not overwrite it first.
    assert not tier.save("b", [5], num_tokens=4)
    tier.take_copies()
    assert tier.save("b", [5], num_tokens=4)


def test_discard_and_recompute_free_the_blocks() -> None:
    tier = HostKVTier(2)
    tier.save("a", [1], num_tokens=8)
    tier.save("b", [2], num_tokens=8)
    tier.discard("a")
    tier.resume_by_recompute("b")
    tier.discard("unknown")
    assert tier.resumed_by_recompute == 1
    assert tier.save("c", [3, 4], num_tokens=16)
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(0)
