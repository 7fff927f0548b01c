"""A KV transfer that fails is never a hang: the decode side recomputes the prompt (or, under the policy
fail, ends the request with an error), counts the fallback, and every block goes back to its pool."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
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


@pytest.fixture(scope="module")
def consumer(tiny_llama: Path) -> Iterator[LLM]:
    llm = make_llm(tiny_llama, "kv_consumer", extra_config={"load_timeout_s": 5})
    yield llm
    shutdown(llm)


@pytest.fixture
def silent_peer() -> Iterator[tuple[str, int]]:
    """A TCP port that takes connections and never answers: a load from it hangs until stopped."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()


def test_a_closed_prefill_replica_means_recompute(
    tiny_llama: Path, consumer: LLM, transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    producer = make_llm(tiny_llama, "kv_producer")
    prompts = random_prompts(3, [20, 45], seed=5)
    params = prefill(producer, prompts)
    shutdown(producer)  # its block server is gone before anyone pulls
    start = free_blocks(consumer)
    before = stats(consumer).kv_transfer_fallbacks.get("unreachable", 0)
    assert decode(consumer, prompts, params) == transformers_greedy(prompts)
    assert stats(consumer).kv_transfer_fallbacks.get("unreachable", 0) - before == len(prompts)
    assert free_blocks(consumer) == start


def test_an_expired_hold_is_freed_and_its_pull_recomputes(
    tiny_llama: Path, consumer: LLM, transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    producer = make_llm(tiny_llama, "kv_producer", extra_config={"hold_timeout_s": 0.2})
    try:
        start_producer, start_consumer = free_blocks(producer), free_blocks(consumer)
        prompts = random_prompts(2, [33, 50], seed=6)
        params = prefill(producer, prompts)
        assert stats(producer).kv_transfer_blocks_held == sum(len(p["remote_block_ids"]) for p in params)
        time.sleep(0.3)
        release_holds(producer)  # nobody pulled: the hold expires and the blocks go back
        assert stats(producer).kv_transfer_holds_expired == len(prompts)
        assert free_blocks(producer) == start_producer
        before = stats(consumer).kv_transfer_fallbacks.get("unknown_transfer", 0)
        assert decode(consumer, prompts, params) == transformers_greedy(prompts)
        assert stats(consumer).kv_transfer_fallbacks.get("unknown_transfer", 0) - before == len(prompts)
        assert free_blocks(consumer) == start_consumer
    finally:
        shutdown(producer)


def test_policy_fail_ends_the_request_with_an_error(tiny_llama: Path) -> None:
    producer = make_llm(tiny_llama, "kv_producer")
    consumer = make_llm(tiny_llama, "kv_consumer", policy="fail")
    try:
        prompts = random_prompts(1, [40], seed=7)
        params = prefill(producer, prompts)
        params[0]["remote_request_id"] = "0" * 32  # a transfer the prefill replica never offered
        output = consumer.generate(prompts, greedy(kv_transfer_params=params[0]))[0]
        assert output.outputs[0].finish_reason == "error"
        assert output.outputs[0].token_ids == []
        assert stats(consumer).kv_transfer_fallbacks == {"unknown_transfer": 1}
    finally:
        shutdown(producer, consumer)


def _hanging_params(peer: tuple[str, int], prompt: list[int]) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "remote_host": peer[0],
        "remote_port": peer[1],
        "remote_block_ids": list(range(-(-len(prompt) // 16))),
        "remote_request_id": "ab" * 16,
    }


@pytest.mark.parametrize("end", ["abort", "deadline"])
def test_a_loading_request_that_ends_frees_its_blocks_once_the_load_stopped(
    consumer: LLM, silent_peer: tuple[str, int], end: str
) -> None:
    engine = consumer.llm_engine
    start = free_blocks(consumer)
    fallbacks = dict(stats(consumer).kv_transfer_fallbacks)
    prompt = random_prompts(1, [40], seed=8)[0]
    params = greedy(kv_transfer_params=_hanging_params(silent_peer, prompt))
    # The deadline lies well past the window below: a request it ended there would leave the steps nothing to
    # wait on, and they would rightly spin.
    engine.add_request(f"hang-{end}", prompt, params, timeout=2.0 if end == "deadline" else None)
    engine.step()
    assert engine.engine_core.scheduler.stats.num_waiting == 1  # waiting for its KV, holding its blocks
    assert free_blocks(consumer) < start
    # Nothing else to run: steps wait on the load instead of spinning.
    began, steps = time.monotonic(), 0
    while time.monotonic() - began < 0.2:
        engine.step()
        steps += 1
    assert engine.engine_core.scheduler.stats.num_waiting == 1
    assert steps < 40
    if end == "abort":
        engine.abort_request(f"hang-{end}")
    outputs = []
    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests() or engine.engine_core.has_pending_kv_transfers():
        assert time.monotonic() < deadline, "the ended load still holds its blocks"
        outputs += engine.step()
    if end == "deadline":
        assert [o.outputs[0].finish_reason for o in outputs] == ["timeout"]
    assert free_blocks(consumer) == start
    assert stats(consumer).kv_transfer_fallbacks == fallbacks  # an ended request is no fallback


def test_requests_waiting_for_their_kv_hold_sequence_slots_but_no_step(
    tiny_llama: Path, silent_peer: tuple[str, int]
) -> None:
    llm = make_llm(tiny_llama, "kv_consumer", max_num_seqs=2)
    engine = llm.llm_engine
    try:
        start = free_blocks(llm)
        for index in range(2):
            prompt = random_prompts(1, [40], seed=10 + index)[0]
            engine.add_request(
                f"hang-{index}", prompt, greedy(kv_transfer_params=_hanging_params(silent_peer, prompt))
            )
        engine.add_request("plain", random_prompts(1, [12], seed=12)[0], greedy())
        began = time.monotonic()
        while time.monotonic() - began < 0.2:
            assert not engine.step(), "both sequence slots are taken by requests waiting for their KV"
        assert engine.engine_core.scheduler.stats.num_running == 0
        engine.abort_request("hang-0")
        # The slot it leaves runs the plain request to its end while the other still waits for its KV.
        outputs = []
        deadline = time.monotonic() + 10
        while not outputs:
            assert time.monotonic() < deadline
            outputs = [output for output in engine.step() if output.finished]
        assert [output.request_id for output in outputs] == ["plain"]
        assert engine.engine_core.scheduler.stats.num_waiting == 1
        engine.abort_request("hang-1")
        while engine.engine_core.has_pending_kv_transfers():
            assert time.monotonic() < deadline
            engine.step()
        assert free_blocks(llm) == start
    finally:
        shutdown(llm)
