"""A fake model runner for driving the scheduler without a model.

It plays the runner's side of the contract strictly: it writes a fake KV entry for every token it is fed
into a simulated paged cache, then checks that every earlier position each request attends to holds the
entry of exactly that request's prefix. So a prefix-cache hit on the wrong block, a block freed while in
use, or a preempted request's half-written block served to another request all fail the test.
"""

from __future__ import annotations

import zlib

import pytest
from kvfleet.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvfleet.runtime.request import Request


class FakeRunner:
    def __init__(self, block_size: int, vocab_size: int = 50) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        # slot -> fake KV entry, a hash of the whole prefix ending at the token stored there.
        self.slots: dict[int, int] = {}
        # Requests whose state the runner holds (dropped on finished/preempted ids, as a real runner does).
        self.known: set[str] = set()
        # Tokens to sample next for a request, in order, before falling back to the deterministic rule.
        self.scripted: dict[str, list[int]] = {}
        self._prefix_hashes: dict[Request, list[int]] = {}
        self.num_steps = 0

    def script(self, request_id: str, token_ids: list[int]) -> None:
        self.scripted.setdefault(request_id, []).extend(token_ids)

    def next_token(self, request: Request) -> int:
        queued = self.scripted.get(request.request_id)
        if queued:
            return queued.pop(0)
        seed = zlib.crc32(request.request_id.encode())
        return (seed + 7 * request.num_tokens) % self.vocab_size

    def kv_entry(self, request: Request, position: int) -> int:
        hashes = self._prefix_hashes.setdefault(request, [])
        tokens = request.all_token_ids
        while len(hashes) <= position:
            parent = hashes[-1] if hashes else 0
            hashes.append(zlib.crc32(f"{parent}:{tokens[len(hashes)]}".encode()))
        return hashes[position]

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self.known -= output.finished_request_ids
        self.known -= output.preempted_request_ids
        rows = list(
            zip(
                output.requests,
                output.num_scheduled_tokens,
                output.num_computed_tokens,
                output.block_ids,
                strict=True,
            )
        )
        assert sum(output.num_scheduled_tokens) == output.total_num_scheduled_tokens
        assert len({request.request_id for request, *_ in rows}) == len(rows), "a request scheduled twice"
        for request, num_new, computed, block_ids in rows:
            assert request.request_id not in output.finished_request_ids
            assert request.request_id not in output.preempted_request_ids
            assert num_new >= 1
            assert computed + num_new <= request.num_tokens
            assert len(block_ids) * self.block_size >= computed + num_new, "block table too short"
            if request.request_id not in self.known:
                # New to the runner (or back after preemption): it starts after whole cached blocks.
                assert computed % self.block_size == 0
            for position in range(computed, computed + num_new):
                self.slots[self.slot(block_ids, position)] = self.kv_entry(request, position)
        # Reads after all writes, as attention runs after the step's K/V are stored.
        for request, num_new, computed, block_ids in rows:
            for position in range(computed + num_new):
                assert self.slots.get(self.slot(block_ids, position)) == self.kv_entry(request, position), (
                    f"{request.request_id}: wrong KV at position {position}"
                )
            self.known.add(request.request_id)
        sampled: list[list[int]] = []
        logprobs: list[list[dict[int, float]] | None] = []
        for request, num_new, computed, _ in rows:
            if computed + num_new == request.num_tokens:
                token_id = self.next_token(request)
                sampled.append([token_id])
                wants_logprobs = request.sampling_params.logprobs is not None
                logprobs.append([{token_id: -0.5}] if wants_logprobs else None)
            else:
                sampled.append([])
                logprobs.append(None)
        return ModelRunnerOutput(
            req_ids=[request.request_id for request in output.requests],
            sampled_token_ids=sampled,
            logprobs=logprobs,
        )


@pytest.fixture(scope="session")
def fake_runner_class() -> type[FakeRunner]:
    return FakeRunner
