"""Random interleavings of arrivals, steps, aborts and clock ticks on small KV pools.

The fake runner checks, every step, that each request reads back exactly its own prefix's KV (so prefix
caching, preemption and frees never hand out wrong or half-written blocks); the invariants below check the
bookkeeping and every limit after every operation; teardown checks that everything ends and is released.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvfleet.runtime.core.scheduler import Scheduler
from kvfleet.runtime.request import FinishReason, Request, RequestStatus
from kvfleet.runtime.sampling_params import SamplingParams

EOS = 0
VOCAB = 16
STOP_IDS = (1, 2)
FINISHED_FROM_OUTSIDE = (
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_ERROR,
)


@st.composite
def scheduler_configs(draw: st.DrawFn, crowded: bool = False) -> dict[str, Any]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_kv_blocks = draw(st.integers(2, 6 if crowded else 10))
    capacity = num_kv_blocks * block_size
    # Long contexts for the pool, so that a few requests run it out and preempt each other.
    max_model_len = draw(st.integers(max(2, capacity // 2), min(24, capacity)))
    chunked = draw(st.booleans())
    low = 1 if chunked else max_model_len
    return {
        "max_num_seqs": draw(st.integers(2 if crowded else 1, 5)),
        "max_num_batched_tokens": draw(st.integers(low, low + 20)),
        "max_model_len": max_model_len,
        "block_size": block_size,
        "num_kv_blocks": num_kv_blocks,
        "enable_prefix_caching": draw(st.booleans()),
        "enable_chunked_prefill": chunked,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
    }


@dataclass
class RequestSpec:
    prompt: list[int]
    params: SamplingParams
    priority: int
    deadline_in: float | None


@st.composite
def request_specs(draw: st.DrawFn, long_lived: bool = False) -> RequestSpec:
    # Few distinct tokens and a common first part, so that prompts often share cached prefixes.
    shared = draw(st.lists(st.just(3), max_size=10))
    prompt = shared + draw(st.lists(st.integers(3, 5), min_size=1, max_size=24))
    max_tokens = draw(st.none() | st.integers(1, 16))
    min_tokens = draw(st.integers(0, 3 if max_tokens is None else min(3, max_tokens)))
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=long_lived or draw(st.booleans()),
        stop_token_ids=[] if long_lived else draw(st.lists(st.sampled_from(STOP_IDS), max_size=2)),
    )
    deadline_in = None if long_lived else draw(st.none() | st.floats(0, 20))
    return RequestSpec(prompt, params, draw(st.integers(0, 3)), deadline_in)


class SchedulerMachine(RuleBasedStateMachine):
    runner_class: type

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.sequence = 0
        self.unfinished: dict[str, Request] = {}
        self.reported_finished: set[str] = set()
        self.finished_from_outside: set[str] = set()

    @initialize(config=scheduler_configs())
    def setup(self, config: dict[str, Any]) -> None:
        self.config = config
        self.scheduler = Scheduler(**config, clock=lambda: self.now)
        self.runner = self.runner_class(config["block_size"], vocab_size=VOCAB)

    @rule(spec=request_specs())
    def add_request(self, spec: RequestSpec) -> None:
        # Prompts are drawn up to the largest max_model_len and cut to this scheduler's.
        prompt = spec.prompt[-self.config["max_model_len"] :]
        self.sequence += 1
        self.now += 0.001  # arrivals are ordered in time, as in a server
        request = Request(
            f"r{self.sequence}",
            prompt,
            spec.params,
            eos_token_id=EOS,
            arrival_time=self.now,
            priority=spec.priority,
            deadline=None if spec.deadline_in is None else self.now + spec.deadline_in,
        )
        self.scheduler.add_request(request)
        self.unfinished[request.request_id] = request

    @rule(num_steps=st.integers(1, 4))
    def run_steps(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step()

    def step(self) -> None:
        config = self.config
        scheduler = self.scheduler
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= config["max_num_batched_tokens"]
        assert len(output.requests) <= config["max_num_seqs"]
        for request, num_new in zip(output.requests, output.num_scheduled_tokens, strict=True):
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            if not config["enable_chunked_prefill"]:
                # A whole prompt (or a resumed request's whole uncached context) at once.
                assert request.num_computed_tokens == request.num_tokens
            assert num_new >= 1
        outputs = scheduler.update_from_output(output, self.runner.execute(output))
        seen = set()
        for out in outputs:
            assert out.request_id not in seen, "one output per request and step"
            seen.add(out.request_id)
            assert out.request_id not in self.finished_from_outside
            request = self.unfinished[out.request_id]
            if out.finish_reason is None:
                continue
            assert out.finish_reason == request.finish_reason
            self._check_finish(request)
            self.reported_finished.add(out.request_id)
            del self.unfinished[out.request_id]

    @precondition(lambda self: bool(self.unfinished))
    @rule(data=st.data(), status=st.sampled_from(FINISHED_FROM_OUTSIDE))
    def finish_from_outside(self, data: st.DataObject, status: RequestStatus) -> None:
        self.finish(data.draw(st.sampled_from(sorted(self.unfinished))), status)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_id, status)
        request = self.unfinished.pop(request_id)
        assert request.status == status
        assert request_id not in self.scheduler.kv_cache_manager.req_to_blocks
        self.finished_from_outside.add(request_id)

    @rule(seconds=st.floats(0.1, 10))
    def advance_clock(self, seconds: float) -> None:
        self.now += seconds

    def _check_finish(self, request: Request) -> None:
        params = request.sampling_params
        last = request.output_token_ids[-1] if request.output_token_ids else None
        if request.finish_reason == FinishReason.TIMEOUT:
            assert request.deadline is not None and request.deadline <= self.now
        elif request.finish_reason == FinishReason.STOP:
            assert request.num_output_tokens >= params.min_tokens
            assert (last == EOS and not params.ignore_eos) or last in params.stop_token_ids
            assert request.stop_reason == (None if last == EOS and not params.ignore_eos else last)
        else:
            assert request.finish_reason == FinishReason.LENGTH
            at_max_tokens = params.max_tokens is not None and request.num_output_tokens == params.max_tokens
            assert at_max_tokens or request.num_tokens >= self.config["max_model_len"]

    @invariant()
    def limits_hold(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        config = self.config
        stats = self.scheduler.stats
        assert stats.num_running <= config["max_num_seqs"]
        assert stats.num_running + stats.num_waiting == len(self.unfinished)
        assert self.scheduler.get_num_unfinished_requests() == len(self.unfinished)
        for request in self.unfinished.values():
            params = request.sampling_params
            if params.max_tokens is not None:
                assert request.num_output_tokens < params.max_tokens
            assert request.num_tokens < config["max_model_len"] or (
                request.num_output_tokens == 0 and request.num_tokens == config["max_model_len"]
            )
            # An unfinished request has emitted no token it should have stopped on.
            for index, token in enumerate(request.output_token_ids):
                if index + 1 >= params.min_tokens:
                    assert token not in params.stop_token_ids
                    assert token != EOS or params.ignore_eos

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        kv = self.scheduler.kv_cache_manager
        pool = kv.block_pool
        block_size = self.config["block_size"]
        holders = [0] * pool.num_blocks
        for request_id, blocks in kv.req_to_blocks.items():
            request = self.unfinished[request_id]
            assert request.status == RequestStatus.RUNNING, "only running requests hold blocks"
            assert len(blocks) == -(-request.num_computed_tokens // block_size), "no block beyond the need"
            assert kv.get_block_ids(request_id) == [block.block_id for block in blocks]
            assert len(set(kv.get_block_ids(request_id))) == len(blocks)
            for block in blocks:
                holders[block.block_id] += 1
        free = {block.block_id for block in pool.free_block_queue}
        assert len(free) == pool.get_num_free_blocks()
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free), "every block is free or referenced"
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        assert sum(block.block_hash is not None for block in pool.blocks) == len(
            pool.cached_block_hash_to_block
        )

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        # Every request must end on its own, with the clock stopped: no starvation, no preemption livelock.
        for _ in range(2000):
            if not self.unfinished:
                break
            self.step()
            self.limits_hold()
            self.blocks_are_accounted_for()
        assert not self.unfinished, f"requests never finished: {sorted(self.unfinished)}"
        assert not self.scheduler.has_unfinished_requests()
        pool = self.scheduler.kv_cache_manager.block_pool
        # Nothing is held; blocks that still carry a hash are free ones kept for the prefix cache.
        assert all(block.ref_cnt == 0 for block in pool.blocks)
        assert pool.get_num_free_blocks() == pool.num_blocks
        assert self.scheduler.stats.kv_cache_usage == 0.0


def test_random_operations_keep_invariants(fake_runner_class: type) -> None:
    SchedulerMachine.runner_class = fake_runner_class
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )


@settings(max_examples=150, deadline=None, database=None)
@given(
    config=scheduler_configs(crowded=True),
    specs=st.lists(request_specs(long_lived=True), min_size=2, max_size=8),
    interruptions=st.lists(st.tuples(st.integers(0, 30), st.sampled_from(FINISHED_FROM_OUTSIDE)), max_size=2),
)
def test_bursts_of_long_requests_preempt_and_still_finish(
    fake_runner_class: type, config: dict[str, Any], specs: list[RequestSpec], interruptions: list
) -> None:
    """Several long-lived requests at once on a small pool: the preemption-heavy case."""
    SchedulerMachine.runner_class = fake_runner_class
    machine = SchedulerMachine()
    machine.setup(config)
    for spec in specs:
        # Short prompts, so that requests hold few blocks when admitted and grow into each other.
        machine.add_request(replace(spec, prompt=spec.prompt[: max(1, config["max_model_len"] // 3)]))
    interrupt_at = dict(interruptions)
    for step_index in range(40):
        if not machine.unfinished:
            break
        machine.step()
        machine.limits_hold()
        machine.blocks_are_accounted_for()
        if step_index in interrupt_at and machine.unfinished:
            machine.finish(sorted(machine.unfinished)[0], interrupt_at[step_index])
    machine.teardown()
