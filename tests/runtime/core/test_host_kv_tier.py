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
    tier.take_copies()
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
    tier.take_copies()  # their copies made, the blocks are free
    assert tier.save("c", [3, 4], num_tokens=16)
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(0)


def test_blocks_written_this_step_are_not_written_again_before_the_copies_are_made() -> None:
    # Two copies into one host block in one step would leave either KV there.
    tier = HostKVTier(2)
    tier.save("a", [1, 2], num_tokens=16)
    assert not tier.save("b", [3], num_tokens=8)
    tier.spill(4, b"h")
    assert tier.claim_prefix([b"h"]) == 0, "nothing free that no copy uses"
    assert len(tier.take_copies().to_host) == 2
    assert tier.save("b", [3], num_tokens=8)
    assert tier.saved_tokens("a") == 0


def test_spilled_prefix_blocks_load_back_and_stay() -> None:
    tier = HostKVTier(4)
    tier.spill(7, b"h1")
    tier.spill(8, b"h2")
    tier.spill(7, b"h1")  # already held: not copied twice
    copies = tier.take_copies()
    assert [device for device, _ in copies.to_host] == [7, 8]
    host_of = {b"h1": copies.to_host[0][1], b"h2": copies.to_host[1][1]}
    assert tier.claim_prefix([b"h1", b"h2", b"h3"]) == 2
    assert tier.claim_prefix([b"h2", b"h1"]) == 2
    assert tier.claim_prefix([b"h3", b"h1"]) == 0, "only from the first hash on"
    tier.load_prefix([b"h1", b"h2"], [3, 5])
    assert tier.take_copies().to_device == [(host_of[b"h1"], 3), (host_of[b"h2"], 5)]
    assert tier.claim_prefix([b"h1", b"h2"]) == 2, "the tier keeps what it loaded"
    assert (tier.prefix_blocks_spilled, tier.prefix_blocks_loaded) == (2, 2)
    tier.reset_prefixes()
    assert tier.claim_prefix([b"h1"]) == 0


def test_prefix_blocks_give_way_to_saves_and_to_newer_prefixes_least_recent_first() -> None:
    tier = HostKVTier(2)
    tier.spill(1, b"old")
    tier.spill(2, b"recent")
    tier.take_copies()
    tier.claim_prefix([b"old"])  # used again: now the most recent
    tier.take_copies()
    tier.spill(3, b"new")
    assert (tier.claim_prefix([b"old"]), tier.claim_prefix([b"recent"]), tier.claim_prefix([b"new"])) == (
        1,
        0,
        1,
    )
    tier.take_copies()
    assert tier.save("r", [4, 5], num_tokens=16), "a save takes the place of prefix blocks"
    assert tier.claim_prefix([b"old"]) == tier.claim_prefix([b"new"]) == 0
    tier.take_copies()
    tier.spill(6, b"newest")  # a prefix block never displaces a save
    assert tier.claim_prefix([b"newest"]) == 0 and tier.saved_tokens("r") == 16


def test_claimed_prefix_blocks_survive_the_steps_spills() -> None:
    tier = HostKVTier(1)
    tier.spill(1, b"h")
    tier.take_copies()
    assert tier.claim_prefix([b"h"]) == 1
    tier.spill(2, b"other")  # the only block is claimed: this spill is skipped
    tier.load_prefix([b"h"], [9])
    assert tier.take_copies().to_device == [(0, 9)]
