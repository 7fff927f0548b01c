"""Prefill on one engine, decode on another, KV blocks pulled over TCP: greedy tokens equal Transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvfleet.runtime import LLM
from pd_engines import (
    decode,
    free_blocks,
    greedy,
    make_llm,
    prefill,
    random_prompts,
    release_holds,
    shutdown,
    stats,
)

BLOCK_SIZE = 16


def _num_blocks(prompt: list[int]) -> int:
    return -(-len(prompt) // BLOCK_SIZE)


def test_prefill_then_decode_equals_transformers(
    pd_pair: tuple[LLM, LLM], transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    producer, consumer = pd_pair
    prompts = random_prompts(6, [3, 17, 31, 40, 66], seed=1)
    before = stats(consumer)
    params = prefill(producer, prompts)
    assert [len(p["remote_block_ids"]) for p in params] == [_num_blocks(p) for p in prompts]
    tokens = decode(consumer, prompts, params)
    assert tokens == transformers_greedy(prompts)
    after = stats(consumer)
    # Every prompt's blocks but the last token's own, when that token opens a block of its own, are pulled;
    # the decode side computes only the last prompt token of each.
    pulled = sum(-(-(len(p) - 1) // BLOCK_SIZE) for p in prompts)
    assert after.kv_transfer_loads - before.kv_transfer_loads == sum(len(p) > 1 for p in prompts)
    assert after.kv_transfer_blocks_pulled - before.kv_transfer_blocks_pulled == pulled
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == len(prompts)
    assert after.kv_transfer_fallbacks == {}
    release_holds(producer)


def test_only_blocks_missing_from_the_prefix_cache_are_pulled(
    pd_pair: tuple[LLM, LLM], transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    producer, consumer = pd_pair
    shared = random_prompts(1, [48], seed=2)[0]  # three full blocks
    # The decode side computed the shared prefix itself before.
    consumer.generate([[*shared, 7]], greedy(1))
    prompts = random_prompts(3, [5, 20, 37], seed=3, prefix=shared)
    before = stats(consumer)
    tokens = decode(consumer, prompts, prefill(producer, prompts))
    assert tokens == transformers_greedy(prompts)
    after = stats(consumer)
    hits = len(shared) // BLOCK_SIZE
    expected = sum(-(-(len(p) - 1) // BLOCK_SIZE) - hits for p in prompts)
    assert after.kv_transfer_blocks_pulled - before.kv_transfer_blocks_pulled == expected
    assert after.prefix_cache_hits - before.prefix_cache_hits == hits * BLOCK_SIZE * len(prompts)
    release_holds(producer)


def test_a_prompt_the_decode_side_caches_whole_pulls_nothing_and_frees_the_hold_at_once(
    pd_pair: tuple[LLM, LLM], transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    producer, consumer = pd_pair
    # Two full blocks and the last token: the decode side's own run caches all that a decode call would pull.
    prompt = random_prompts(1, [2 * BLOCK_SIZE + 1], seed=5)[0]
    consumer.generate([prompt], greedy(1))
    params = prefill(producer, [prompt])
    assert stats(producer).kv_transfer_blocks_held == 3
    before = stats(consumer)
    assert decode(consumer, [prompt], params) == transformers_greedy([prompt])
    after = stats(consumer)
    assert after.kv_transfer_blocks_pulled == before.kv_transfer_blocks_pulled
    assert after.kv_transfer_loads == before.kv_transfer_loads and after.kv_transfer_fallbacks == {}
    # Released by the decode side's empty pull, long before hold_timeout_s (120 s).
    release_holds(producer)
    assert stats(producer).kv_transfer_holds_expired == 0


def test_chunked_prefill_with_a_small_budget(
    tiny_llama: Path, transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    options = {"max_num_batched_tokens": 24, "max_num_seqs": 4}
    producer = make_llm(tiny_llama, "kv_producer", **options)
    consumer = make_llm(tiny_llama, "kv_consumer", **options)
    try:
        start = free_blocks(producer), free_blocks(consumer)
        prompts = random_prompts(5, [30, 57, 90], seed=4)
        tokens = decode(consumer, prompts, prefill(producer, prompts))
        assert tokens == transformers_greedy(prompts)
        release_holds(producer)
        assert stats(producer).kv_transfer_holds_expired == 0  # every offer was pulled to the end
        assert (free_blocks(producer), free_blocks(consumer)) == start
    finally:
        shutdown(producer, consumer)
