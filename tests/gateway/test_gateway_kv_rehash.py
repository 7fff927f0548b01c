"""A vLLM replica's blocks, keyed by kvfleet's block-hash rule over their tokens, so that the hashes the
gateway computes for a prompt find them."""

from __future__ import annotations

import random

from kvfleet.contract.block_hash import block_hashes, external_block_hash
from kvfleet.gateway.kv_rehash import TokenRehasher
from kvfleet.runtime.kv_events.wire import BlockStored

BLOCK = 16


def _prompt_hashes(tokens: list[int]) -> list[int]:
    return [external_block_hash(h) for h in block_hashes(tokens, BLOCK, None)]


def _stored(engine_hashes: list[int], parent: int | None, tokens: list[int], **fields: object) -> BlockStored:
    values = {"lora_id": None, "medium": "GPU", "lora_name": None, **fields}
    return BlockStored(engine_hashes, parent, tokens, BLOCK, **values)  # type: ignore[arg-type]


def test_a_prompt_stored_in_two_events_is_found_under_the_gateways_hashes() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(16, 30000) for _ in range(5 * BLOCK)]
    # vLLM's own hashes: nothing kvfleet can compute.
    engine = [rng.getrandbits(64) for _ in range(5)]
    rehasher = TokenRehasher(max_entries=100)
    first = rehasher.stored(_stored(engine[:2], None, tokens[: 2 * BLOCK]))
    rest = rehasher.stored(_stored(engine[2:], engine[1], tokens[2 * BLOCK :]))
    assert first + rest == _prompt_hashes(tokens)
    assert rehasher.removed([engine[3], 12345]) == [_prompt_hashes(tokens)[3]]


def test_blocks_it_cannot_key_by_their_tokens_are_left_out() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(16, 30000) for _ in range(3 * BLOCK)]
    engine = [rng.getrandbits(64) for _ in range(3)]
    rehasher = TokenRehasher(max_entries=100)
    # A parent it never saw stored: the chain's start is unknown.
    assert rehasher.stored(_stored(engine[1:], 999, tokens[BLOCK:])) == []
    assert rehasher.stored(_stored(engine, None, tokens, lora_id=3, lora_name="sql")) == []
    # A block whose hash covers an image or a salt stops the chain there.
    keyed = rehasher.stored(_stored(engine, None, tokens, extra_keys=[None, ["salt"], None]))
    assert keyed == _prompt_hashes(tokens)[:1]


def test_it_remembers_at_most_its_cap() -> None:
    rng = random.Random(2)
    rehasher = TokenRehasher(max_entries=2)
    tokens = [rng.randrange(16, 30000) for _ in range(3 * BLOCK)]
    engine = [11, 12, 13]
    rehasher.stored(_stored(engine, None, tokens))
    assert rehasher.removed(engine) == _prompt_hashes(tokens)[1:]
