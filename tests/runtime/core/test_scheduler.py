from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
from kvfleet.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvfleet.runtime.core.scheduler import Scheduler
from kvfleet.runtime.errors import InvalidContinuationError
from kvfleet.runtime.request import FinishReason, Request, RequestStatus
from kvfleet.runtime.sampling_params import SamplingParams

BLOCK = 4
EOS = 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(**overrides: Any) -> Scheduler:
    options: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "block_size": BLOCK,
        "num_kv_blocks": 64,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "policy": "fcfs",
    }
    options.update(overrides)
    return Scheduler(**options)


def make_request(
    request_id: str,
    prompt: list[int] | int = 5,
    *,
    arrival_time: float | None = None,
    priority: int = 0,
    deadline: float | None = None,
    eos_token_id: int | None = EOS,
    **params: Any,
) -> Request:
    # Prompts given by length differ from the first token, so they share no cached prefix.
    first = 1000 * (1 + zlib.crc32(request_id.encode()) % 1000)
    prompt_ids = prompt if isinstance(prompt, list) else [first + i for i in range(prompt)]
    params.setdefault("max_tokens", 8)
    return Request(
        request_id,
        prompt_ids,
        SamplingParams(**params),
        eos_token_id=eos_token_id,
        arrival_time=float(len(request_id)) if arrival_time is None else arrival_time,
        priority=priority,
        deadline=deadline,
    )


@pytest.fixture
def runner_factory(fake_runner_class: type) -> Callable[[Scheduler], Any]:
    def build(scheduler: Scheduler) -> Any:
        return fake_runner_class(scheduler.kv_cache_manager.block_size)

    return build


def step(scheduler: Scheduler, runner: Any) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, runner.execute(output))


def scheduled(output: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)}


def run_to_completion(scheduler: Scheduler, runner: Any, max_steps: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        _, outputs = step(scheduler, runner)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("requests did not finish")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_blocks


class TestBatching:
    def test_prefill_then_decode_in_one_flow(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 6, max_tokens=3))
        output, outputs = step(scheduler, runner)
        assert scheduled(output) == {"a": 6}
        assert output.num_computed_tokens == [0]
        assert output.block_ids == [[0, 1]]
        request = output.requests[0]
        assert [(out.request_id, out.new_token_ids, out.finish_reason) for out in outputs] == [
            ("a", request.output_token_ids, None)
        ]
        assert request.num_computed_tokens == 6
        assert request.num_output_tokens == 1
        output, outputs = step(scheduler, runner)
        assert scheduled(output) == {"a": 1}
        assert output.num_computed_tokens == [6]
        output, outputs = step(scheduler, runner)
        assert outputs[0].finish_reason == FinishReason.LENGTH
        assert request.output_token_ids == request.all_token_ids[6:]
        assert request.num_output_tokens == 3
        assert not scheduler.has_unfinished_requests()
        assert_all_blocks_free(scheduler)
        # The runner hears about the finished request in the next step.
        assert scheduler.schedule().finished_request_ids == {"a"}

    def test_token_budget_is_shared_running_first(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_batched_tokens=10)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 7))
        scheduler.add_request(make_request("bb", 7))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 7, "bb": 3}
        assert output.total_num_scheduled_tokens == 10
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 1, "bb": 4}
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 1, "bb": 1}

    def test_max_num_seqs(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_seqs=2)
        runner = runner_factory(scheduler)
        for name in ("a", "bb", "ccc"):
            scheduler.add_request(make_request(name, 3, max_tokens=2))
        output, _ = step(scheduler, runner)
        assert list(scheduled(output)) == ["a", "bb"]
        assert scheduler.stats.num_waiting == 1
        output, _ = step(scheduler, runner)
        assert list(scheduled(output)) == ["a", "bb"]
        output, _ = step(scheduler, runner)
        assert list(scheduled(output)) == ["ccc"]

    def test_chunked_prefill_splits_a_long_prompt(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_batched_tokens=16)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 40, max_tokens=2))
        chunks = []
        for _ in range(3):
            output, _ = step(scheduler, runner)
            chunks.append((output.num_computed_tokens[0], output.num_scheduled_tokens[0]))
        assert chunks == [(0, 16), (16, 16), (32, 8)]
        assert output.requests[0].num_output_tokens == 1

    def test_chunk_boundaries_do_not_sample(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_batched_tokens=16)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 40, max_tokens=2))
        outputs_per_step = [step(scheduler, runner)[1] for _ in range(3)]
        assert [len(outputs) for outputs in outputs_per_step] == [0, 0, 1]

    def test_chunked_prefill_off_admits_only_whole_prompts(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 40))
        scheduler.add_request(make_request("bb", 30))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 40}
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 1, "bb": 30}

    def test_chunked_prefill_off_needs_a_budget_for_the_longest_prompt(self) -> None:
        with pytest.raises(ValueError, match="chunked prefill"):
            make_scheduler(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)

    def test_a_long_prompt_takes_the_threshold_beside_others_and_the_budget_alone(
        self, runner_factory: Callable
    ) -> None:
        scheduler = make_scheduler(long_prefill_token_threshold=8)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 20, max_tokens=2))
        scheduler.add_request(make_request("bb", 6, max_tokens=2))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 8, "bb": 6}
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 8, "bb": 1}
        # bb has its two tokens: a is alone, and takes the rest of its prompt at once.
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 4}
        # A request that arrives while another runs is held to the threshold too.
        scheduler.add_request(make_request("ccc", 30, max_tokens=2))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 1, "ccc": 8}
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"ccc": 22}

    def test_fcfs_admits_in_arrival_order(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_seqs=1)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("late", 3, arrival_time=2.0, priority=-5, max_tokens=1))
        scheduler.add_request(make_request("early", 3, arrival_time=1.0, priority=5, max_tokens=1))
        order = [list(scheduled(step(scheduler, runner)[0])) for _ in range(2)]
        assert order == [["late"], ["early"]]  # fcfs = order of add_request, priority ignored

    def test_priority_admits_lowest_value_then_earliest(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_num_seqs=1, policy="priority")
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("p5", 3, arrival_time=1.0, priority=5, max_tokens=1))
        scheduler.add_request(make_request("p0-late", 3, arrival_time=3.0, priority=0, max_tokens=1))
        scheduler.add_request(make_request("p0-early", 3, arrival_time=2.0, priority=0, max_tokens=1))
        order = [list(scheduled(step(scheduler, runner)[0])) for _ in range(3)]
        assert order == [["p0-early"], ["p0-late"], ["p5"]]

    def test_blocks_bound_admission(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=4, max_model_len=16)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 9, max_tokens=2))
        scheduler.add_request(make_request("bb", 5, max_tokens=2))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 9}  # bb needs 2 blocks, 1 is free
        assert scheduler.stats.num_waiting == 1


class TestPreemption:
    def _fill(self, scheduler: Scheduler, runner: Any, requests: list[Request]) -> None:
        for request in requests:
            scheduler.add_request(request)
        output, _ = step(scheduler, runner)
        assert len(output.requests) == len(requests)

    def test_fcfs_preempts_the_newest_arrival(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=3, max_model_len=12)
        runner = runner_factory(scheduler)
        # Each fills one block exactly, so the next token of each needs a new block; only one is free.
        self._fill(
            scheduler,
            runner,
            [
                make_request("old", 4, arrival_time=1.0, max_tokens=4),
                make_request("new", 4, arrival_time=2.0, max_tokens=4),
            ],
        )
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"old": 1}
        assert output.preempted_request_ids == {"new"}
        new = scheduler.requests["new"]
        assert new.status == RequestStatus.PREEMPTED
        assert new.num_computed_tokens == 0
        assert new.num_preemptions == 1
        assert scheduler.stats.num_preempted_total == 1
        assert scheduler.stats.num_running == 1
        assert scheduler.stats.num_waiting == 1

    def test_priority_preempts_the_worst_priority_even_if_older(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=3, max_model_len=12, policy="priority")
        runner = runner_factory(scheduler)
        self._fill(
            scheduler,
            runner,
            [
                make_request("vip", 4, arrival_time=2.0, priority=0, max_tokens=4),
                make_request("low", 4, arrival_time=1.0, priority=3, max_tokens=4),
            ],
        )
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"low"}
        assert scheduled(output) == {"vip": 1}

    def test_priority_victim_scheduled_earlier_in_the_step_gives_back_its_budget(
        self, runner_factory: Callable
    ) -> None:
        scheduler = make_scheduler(num_kv_blocks=3, max_model_len=12, policy="priority")
        runner = runner_factory(scheduler)
        # "low" is admitted first (it arrived first), so it is scheduled before "vip" in the next step.
        scheduler.add_request(make_request("low", 4, arrival_time=1.0, priority=3, max_tokens=4))
        step(scheduler, runner)
        scheduler.add_request(make_request("vip", 4, arrival_time=2.0, priority=0, max_tokens=4))
        output, _ = step(scheduler, runner)
        assert list(scheduled(output)) == ["low", "vip"]
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"low"}
        assert scheduled(output) == {"vip": 1}
        assert output.total_num_scheduled_tokens == 1
        assert scheduler.requests["low"].status == RequestStatus.PREEMPTED

    @pytest.mark.parametrize("policy", ["priority", "fcfs"])
    def test_a_higher_tier_takes_a_full_batchs_slot_only_under_priority(
        self, runner_factory: Callable, policy: str
    ) -> None:
        scheduler = make_scheduler(max_num_seqs=2, policy=policy)
        runner = runner_factory(scheduler)
        self._fill(
            scheduler,
            runner,
            [
                make_request("batch-old", 4, arrival_time=1.0, priority=3, max_tokens=8),
                make_request("batch-new", 4, arrival_time=2.0, priority=3, max_tokens=8),
            ],
        )
        scheduler.add_request(make_request("critical", 4, arrival_time=3.0, priority=0, max_tokens=2))
        output, _ = step(scheduler, runner)
        if policy == "fcfs":
            assert output.preempted_request_ids == set()
            assert set(scheduled(output)) == {"batch-old", "batch-new"}
            return
        assert output.preempted_request_ids == {"batch-new"}
        assert scheduled(output) == {"batch-old": 1, "critical": 4}
        # Equal priorities never displace each other: batch-new waits for a free slot.
        step(scheduler, runner)
        assert scheduler.requests["batch-new"].status == RequestStatus.PREEMPTED
        tokens = run_to_completion(scheduler, runner)
        assert set(tokens) >= {"batch-old", "batch-new"}
        assert scheduler.stats.kv_cache_usage == 0.0

    def test_a_higher_tier_displaces_lower_ones_when_blocks_run_short(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=4, max_model_len=16, policy="priority")
        runner = runner_factory(scheduler)
        self._fill(scheduler, runner, [make_request("batch", 12, arrival_time=1.0, priority=3, max_tokens=4)])
        scheduler.add_request(make_request("critical", 8, arrival_time=2.0, priority=0, max_tokens=2))
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"batch"}
        assert scheduled(output) == {"critical": 8}

    def test_a_displaced_request_is_not_readmitted_in_the_step_that_displaced_it(
        self, runner_factory: Callable
    ) -> None:
        scheduler = make_scheduler(num_kv_blocks=4, max_model_len=16, policy="priority")
        runner = runner_factory(scheduler)
        shared = [7, 7, 7, 7]
        self._fill(
            scheduler,
            runner,
            [
                make_request("anchor", [*shared, 8], arrival_time=1.0, priority=0, max_tokens=2),
                make_request("low", 1, arrival_time=2.0, priority=3, max_tokens=8),
            ],
        )
        # anchor holds 2 blocks (its next token fits in them) and low 1: the one free block looks short for
        # high's 8 tokens, so low is displaced; high then hits anchor's cached first block and needs only one
        # more, which leaves the block low would fit in again.
        scheduler.add_request(make_request("high", [*shared, 1, 2, 3, 4], arrival_time=3.0, priority=0))
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"low"}
        assert scheduled(output) == {"anchor": 1, "high": 4}
        assert scheduler.requests["low"].status == RequestStatus.PREEMPTED
        output, _ = step(scheduler, runner)
        assert "low" in scheduled(output), "re-admitted in the next step, once it is not the one displaced"
        run_to_completion(scheduler, runner)
        assert_all_blocks_free(scheduler)

    def test_a_victim_scheduled_earlier_in_the_step_leaves_no_unwritten_block_in_the_cache(
        self, runner_factory: Callable
    ) -> None:
        scheduler = make_scheduler(
            block_size=2, num_kv_blocks=16, max_model_len=32, max_num_batched_tokens=12, policy="priority"
        )
        runner = runner_factory(scheduler)
        victim = make_request("victim", [11, 12, 13], arrival_time=1.0, priority=3, max_tokens=20)
        scheduler.add_request(victim)
        step(scheduler, runner)
        scheduler.add_request(make_request("steady", [21], arrival_time=2.0, priority=0, max_tokens=20))
        scheduler.add_request(make_request("big", 30, arrival_time=3.0, priority=2))
        step(scheduler, runner)
        step(scheduler, runner)
        # Step 4: victim's token fills its third block, then big's 5-block chunk finds 1 free block, preempts
        # victim (scheduled before it in this step) and then itself, as steady outranks it.
        third_block = scheduler.kv_cache_manager.req_to_blocks["victim"][2]
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"victim", "big"}
        assert scheduled(output) == {"steady": 1}
        assert third_block.block_hash is None, "a block whose token never ran must not be findable"
        # A request sharing victim's tokens must recompute that block rather than read it.
        scheduler.add_request(
            make_request("reader", [*victim.all_token_ids, 99], arrival_time=4.0, priority=0)
        )
        output, _ = step(scheduler, runner)
        assert (
            dict(zip([r.request_id for r in output.requests], output.num_computed_tokens, strict=True))[
                "reader"
            ]
            == 4
        )

    def test_a_request_that_is_its_own_victim_is_not_scheduled(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=2, max_model_len=8)
        runner = runner_factory(scheduler)
        self._fill(
            scheduler,
            runner,
            [make_request("old", 4, arrival_time=1.0), make_request("new", 4, arrival_time=2.0)],
        )
        output, _ = step(scheduler, runner)
        # old needs a block: it preempts new, gets new's block.
        assert output.preempted_request_ids == {"new"}
        assert scheduled(output) == {"old": 1}

    def test_preempted_request_resumes_with_its_cached_prefix(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=6, max_model_len=24)
        runner = runner_factory(scheduler)
        self._fill(
            scheduler,
            runner,
            [
                make_request("old", 12, arrival_time=1.0, max_tokens=2),
                make_request("new", 10, arrival_time=2.0, max_tokens=8),
            ],
        )
        # old (3 blocks) and new (3 blocks) fill the pool; old's 13th token needs a 4th block.
        new = scheduler.requests["new"]
        first_token = new.output_token_ids[0]
        full_blocks = scheduler.kv_cache_manager.get_block_ids("new")[:2]
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"new"}
        assert scheduled(output) == {"old": 1}
        stats_before = scheduler.stats
        # old ends in that step; new comes back with its 2 full blocks from the cache and recomputes the
        # partial one (2 prompt tokens) plus its pending sampled token.
        output, _ = step(scheduler, runner)
        assert output.finished_request_ids == {"old"}
        assert scheduled(output) == {"new": 3}
        assert output.num_computed_tokens == [8]
        assert output.block_ids[0][:2] == full_blocks
        stats = scheduler.stats
        assert stats.prefix_cache_hits - stats_before.prefix_cache_hits == 8
        assert stats.num_prefill_tokens_computed - stats_before.num_prefill_tokens_computed == 2
        assert new.num_cached_tokens == 0  # as first scheduled
        tokens = run_to_completion(scheduler, runner)
        assert new.status == RequestStatus.FINISHED_LENGTH
        assert new.output_token_ids[0] == first_token
        assert new.num_output_tokens == 8
        assert len(tokens["new"]) == 6
        assert_all_blocks_free(scheduler)

    def test_no_admission_in_a_step_that_preempted(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(num_kv_blocks=3, max_model_len=12)
        runner = runner_factory(scheduler)
        self._fill(
            scheduler,
            runner,
            [make_request("old", 4, arrival_time=1.0), make_request("new", 4, arrival_time=2.0)],
        )
        scheduler.add_request(make_request("tiny", 1, arrival_time=3.0))
        output, _ = step(scheduler, runner)
        assert output.preempted_request_ids == {"new"}
        assert "tiny" not in scheduled(output)
        # The preempted request goes back to the front of the queue.
        assert scheduler.waiting.peek() is scheduler.requests["new"]


class TestFinishing:
    def test_eos_stops_and_is_kept(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a"))
        runner.script("a", [7, EOS, 9])
        tokens = run_to_completion(scheduler, runner)
        assert tokens == {"a": [7, EOS]}
        assert scheduler.schedule().finished_request_ids == {"a"}

    def test_finish_output_fields(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 9, stop_token_ids=[42], logprobs=1))
        runner.script("a", [42])
        _, outputs = step(scheduler, runner)
        assert outputs == [
            EngineCoreOutput(
                request_id="a",
                new_token_ids=[42],
                new_logprobs=[{42: -0.5}],
                finish_reason=FinishReason.STOP,
                stop_reason=42,
                num_cached_tokens=0,
            )
        ]
        assert outputs[0].finished

    def test_ignore_eos(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", ignore_eos=True, max_tokens=3))
        runner.script("a", [EOS, EOS, EOS])
        assert run_to_completion(scheduler, runner) == {"a": [EOS, EOS, EOS]}
        assert scheduler.stats.num_running == 0

    def test_no_eos_token_id(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", eos_token_id=None, max_tokens=2))
        runner.script("a", [EOS, EOS])
        assert run_to_completion(scheduler, runner) == {"a": [EOS, EOS]}

    @pytest.mark.parametrize("stop_kind", ["eos", "stop_token"])
    def test_min_tokens_delays_stops(self, runner_factory: Callable, stop_kind: str) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        stop_id = EOS if stop_kind == "eos" else 33
        scheduler.add_request(make_request("a", min_tokens=3, stop_token_ids=[33]))
        runner.script("a", [stop_id, stop_id, stop_id, 5])
        tokens = run_to_completion(scheduler, runner)
        assert tokens == {"a": [stop_id, stop_id, stop_id]}

    def test_max_tokens(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", max_tokens=5))
        scheduler.add_request(make_request("bb", max_tokens=1))
        tokens = run_to_completion(scheduler, runner)
        assert {name: len(ids) for name, ids in tokens.items()} == {"a": 5, "bb": 1}

    def test_max_model_len_caps_unlimited_max_tokens(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_model_len=12)
        runner = runner_factory(scheduler)
        request = make_request("a", 5, max_tokens=None)
        scheduler.add_request(request)
        outputs = []
        while scheduler.has_unfinished_requests():
            outputs.extend(step(scheduler, runner)[1])
        assert request.num_tokens == 12
        assert outputs[-1].finish_reason == FinishReason.LENGTH

    def test_prompt_as_long_as_max_model_len_gets_one_token(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_model_len=12)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 12))
        assert {k: len(v) for k, v in run_to_completion(scheduler, runner).items()} == {"a": 1}

    def test_stop_in_the_middle_of_several_sampled_tokens_truncates(self) -> None:
        scheduler = make_scheduler()
        scheduler.add_request(make_request("a", 3, stop_token_ids=[8], logprobs=0))
        output = scheduler.schedule()
        result = ModelRunnerOutput(["a"], [[7, 8, 9]], [[{7: -1.0}, {8: -2.0}, {9: -3.0}]])
        (out,) = scheduler.update_from_output(output, result)
        assert out.new_token_ids == [7, 8]
        assert out.new_logprobs == [{7: -1.0}, {8: -2.0}]
        assert out.stop_reason == 8
        assert output.requests[0].output_token_ids == [7, 8]

    def test_min_tokens_bigger_than_max_model_len_room_still_ends(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(max_model_len=8)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 6, max_tokens=None, min_tokens=100))
        assert {k: len(v) for k, v in run_to_completion(scheduler, runner).items()} == {"a": 2}


class TestAbort:
    @pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
    def test_abort_in_every_state_frees_blocks_at_once(self, runner_factory: Callable, state: str) -> None:
        scheduler = make_scheduler(num_kv_blocks=6, max_model_len=24, max_num_batched_tokens=8)
        runner = runner_factory(scheduler)
        if state == "preempted":
            scheduler.add_request(make_request("other", 12, arrival_time=0.0, max_tokens=20))
            scheduler.add_request(make_request("a", 8, arrival_time=1.0, max_tokens=20))
            for _ in range(6):
                step(scheduler, runner)
                if scheduler.requests["a"].status == RequestStatus.PREEMPTED:
                    break
        else:
            scheduler.add_request(make_request("a", 12, max_tokens=20))
            steps = {"waiting": 0, "prefilling": 1, "decoding": 3}[state]
            for _ in range(steps):
                step(scheduler, runner)
        request = scheduler.requests["a"]
        expected_status = {
            "waiting": RequestStatus.WAITING,
            "prefilling": RequestStatus.RUNNING,
            "decoding": RequestStatus.RUNNING,
            "preempted": RequestStatus.PREEMPTED,
        }[state]
        assert request.status == expected_status
        if state == "prefilling":
            assert request.num_computed_tokens < request.num_prompt_tokens
        if state == "decoding":
            assert request.num_output_tokens > 0
        held_before = scheduler.kv_cache_manager.req_to_blocks.get("a", [])
        scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert request.finish_reason == FinishReason.ABORT
        assert "a" not in scheduler.kv_cache_manager.req_to_blocks
        assert all(block.ref_cnt == 0 for block in held_before)
        assert "a" not in scheduler.requests
        assert (
            scheduler.stats.num_running + scheduler.stats.num_waiting
            == scheduler.get_num_unfinished_requests()
        )
        output = scheduler.schedule()
        assert "a" in output.finished_request_ids
        assert "a" not in scheduled(output)
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
        assert_all_blocks_free(scheduler)
        assert not scheduler.has_unfinished_requests()

    def test_abort_between_schedule_and_update_drops_the_token(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a"))
        output = scheduler.schedule()
        result = runner.execute(output)
        scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
        assert scheduler.update_from_output(output, result) == []
        assert output.requests[0].output_token_ids == []
        assert_all_blocks_free(scheduler)

    def test_finish_requests_needs_a_finished_status(self) -> None:
        scheduler = make_scheduler()
        with pytest.raises(ValueError, match="RUNNING is not a finished status"):
            scheduler.finish_requests("a", RequestStatus.RUNNING)

    def test_error_clears_the_prefix_cache(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 9))
        scheduler.add_request(make_request("bb", 9))
        output = scheduler.schedule()
        assert scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        scheduler.finish_requests(["a", "bb"], RequestStatus.FINISHED_ERROR)
        assert scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
        scheduler.update_from_output(output, runner.execute(output))
        assert_all_blocks_free(scheduler)


class TestDeadlines:
    def test_deadline_times_out_waiting_and_running_requests(self, runner_factory: Callable) -> None:
        clock = Clock()
        scheduler = make_scheduler(clock=clock, max_num_seqs=1)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("running", 5, deadline=105.0, max_tokens=100))
        scheduler.add_request(make_request("waiting", 5, deadline=103.0))
        scheduler.add_request(make_request("patient", 5, deadline=1000.0, max_tokens=3))
        step(scheduler, runner)
        clock.now = 103.0
        output, outputs = step(scheduler, runner)
        assert "waiting" in output.finished_request_ids
        timed_out = [out for out in outputs if out.finish_reason == FinishReason.TIMEOUT]
        assert [(out.request_id, out.new_token_ids) for out in timed_out] == [("waiting", [])]
        clock.now = 105.0
        output, outputs = step(scheduler, runner)
        assert "running" in output.finished_request_ids
        assert "running" not in scheduled(output)
        assert [out.request_id for out in outputs if out.finish_reason == FinishReason.TIMEOUT] == ["running"]
        assert list(scheduled(output)) == ["patient"]
        tokens = run_to_completion(scheduler, runner)
        assert len(tokens["patient"]) == 2
        assert_all_blocks_free(scheduler)

    def test_deadline_in_the_past_times_out_before_running(self, runner_factory: Callable) -> None:
        clock = Clock()
        scheduler = make_scheduler(clock=clock)
        runner = runner_factory(scheduler)
        request = make_request("late", 5, deadline=clock.now - 1)
        scheduler.add_request(request)
        output, outputs = step(scheduler, runner)
        assert output.requests == []
        assert outputs[0].finish_reason == FinishReason.TIMEOUT
        assert request.status == RequestStatus.FINISHED_TIMED_OUT
        assert not scheduler.has_unfinished_requests()

    def test_a_timeout_counts_as_unfinished_until_reported(self, runner_factory: Callable) -> None:
        clock = Clock()
        scheduler = make_scheduler(clock=clock)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 5, deadline=clock.now + 1))
        step(scheduler, runner)
        clock.now += 2
        # The step fails (the engine finishes its requests and skips update_from_output) ...
        scheduler.schedule()
        assert scheduler.has_unfinished_requests()
        assert scheduler.get_num_unfinished_requests() == 1
        # ... so the next step still reports the timeout.
        _, outputs = step(scheduler, runner)
        assert [(out.request_id, out.finish_reason) for out in outputs] == [("a", FinishReason.TIMEOUT)]
        assert not scheduler.has_unfinished_requests()

    def test_requests_that_finished_first_leave_no_timeout(self, runner_factory: Callable) -> None:
        clock = Clock()
        scheduler = make_scheduler(clock=clock)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("quick", 5, deadline=clock.now + 10, max_tokens=1))
        step(scheduler, runner)
        clock.now += 20
        _, outputs = step(scheduler, runner)
        assert outputs == []


class TestContinuations:
    """A request that arrives with output tokens (delivered by another replica) goes on from them."""

    def _run(self, scheduler: Scheduler, runner: Any, request: Request) -> list[EngineCoreOutput]:
        scheduler.add_request(request)
        outputs = []
        while scheduler.has_unfinished_requests():
            outputs += step(scheduler, runner)[1]
        return outputs

    @pytest.mark.parametrize("num_resumed", [1, 5, 9])
    def test_it_computes_its_output_with_its_prompt_and_ends_as_uninterrupted(
        self, runner_factory: Callable, num_resumed: int
    ) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        # min_tokens keeps the fake runner's eos from ending it early; the resumed tokens count toward both.
        whole = self._run(scheduler, runner, make_request("r", 6, max_tokens=10, min_tokens=10))
        tokens = [token for output in whole for token in output.new_token_ids]
        assert len(tokens) == 10 and whole[-1].finish_reason == FinishReason.LENGTH
        step(scheduler, runner)  # the runner hears the first run finished before its id comes back
        resumed = make_request("r", 6, max_tokens=10, min_tokens=10)
        resumed.append_output_token_ids(tokens[:num_resumed])
        scheduler.add_request(resumed)
        first, outputs = step(scheduler, runner)
        # The prompt and the output so far (less the cached blocks) in one step, then one token sampled.
        assert first.num_computed_tokens[0] + first.num_scheduled_tokens[0] == 6 + num_resumed
        assert resumed.num_cached_tokens == (6 + num_resumed - 1) // BLOCK * BLOCK
        while scheduler.has_unfinished_requests():
            outputs += step(scheduler, runner)[1]
        assert [token for output in outputs for token in output.new_token_ids] == tokens[num_resumed:]
        assert outputs[-1].finish_reason == FinishReason.LENGTH

    @pytest.mark.parametrize(
        ("resumed", "params"),
        [
            ([3, 4, EOS], {}),  # eos, with min_tokens met
            ([3, 7, 4], {"stop_token_ids": [7]}),
            ([3, 4, 5, 6], {"max_tokens": 4}),
        ],
    )
    def test_one_its_output_would_have_ended_is_refused(
        self, resumed: list[int], params: dict[str, Any]
    ) -> None:
        request = make_request("r", 6, **params)
        request.append_output_token_ids(resumed)
        with pytest.raises(InvalidContinuationError, match="resumed token"):
            make_scheduler().add_request(request)

    def test_eos_before_min_tokens_goes_on(self) -> None:
        request = make_request("r", 6, min_tokens=4)
        request.append_output_token_ids([3, EOS, 4])
        scheduler = make_scheduler()
        scheduler.add_request(request)
        assert scheduler.has_unfinished_requests()


class TestValidation:
    def test_add_request_checks(self) -> None:
        scheduler = make_scheduler(max_model_len=16)
        scheduler.add_request(make_request("a"))
        with pytest.raises(ValueError, match="already in use"):
            scheduler.add_request(make_request("a"))
        with pytest.raises(ValueError, match="max_model_len"):
            scheduler.add_request(make_request("long", 17))
        finished = make_request("done")
        finished.status = RequestStatus.FINISHED_ABORTED
        with pytest.raises(ValueError, match="must be new"):
            scheduler.add_request(finished)

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            ({"max_num_seqs": 0}, "max_num_seqs"),
            ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
            ({"num_kv_blocks": 2}, "KV cache capacity"),
            ({"policy": "lifo"}, "fcfs or priority"),
            ({"long_prefill_token_threshold": -1}, r"long_prefill_token_threshold \(-1\) must be from 0"),
            ({"long_prefill_token_threshold": 65}, r"to max_model_len \(64\)"),
            (
                {"long_prefill_token_threshold": 8, "enable_chunked_prefill": False},
                "it needs chunked prefill",
            ),
        ],
    )
    def test_constructor_checks(self, overrides: dict[str, Any], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            make_scheduler(**overrides)

    def test_runner_output_must_match_the_batch(self) -> None:
        scheduler = make_scheduler()
        scheduler.add_request(make_request("a", 3))
        output = scheduler.schedule()
        with pytest.raises(ValueError, match="1 requests"):
            scheduler.update_from_output(output, ModelRunnerOutput([], [], []))
        with pytest.raises(ValueError, match="'b'"):
            scheduler.update_from_output(output, ModelRunnerOutput(["b"], [[1]], [None]))

    def test_sampling_before_the_prompt_ends_is_rejected(self) -> None:
        scheduler = make_scheduler(max_num_batched_tokens=4)
        scheduler.add_request(make_request("a", 9))
        output = scheduler.schedule()
        with pytest.raises(ValueError, match="before its prefill ended"):
            scheduler.update_from_output(output, ModelRunnerOutput(["a"], [[1]], [None]))


class TestPrefixCaching:
    def test_shared_prefix_hits_and_counters(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        system = list(range(200, 212))
        scheduler.add_request(make_request("a", [*system, 1, 2], max_tokens=2))
        run_to_completion(scheduler, runner)
        scheduler.add_request(make_request("bb", [*system, 3], max_tokens=2))
        output, outputs = step(scheduler, runner)
        assert output.num_computed_tokens == [12]
        assert scheduled(output) == {"bb": 1}
        assert outputs[0].num_cached_tokens == 12
        stats = scheduler.stats
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14 + 13, 12)
        assert stats.num_prefill_tokens_computed == 14 + 1

    def test_requests_admitted_in_the_same_step_share_blocks(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        system = list(range(200, 212))
        scheduler.add_request(make_request("a", [*system, 1]))
        scheduler.add_request(make_request("bb", [*system, 2]))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 13, "bb": 1}
        assert output.block_ids[0][:3] == output.block_ids[1][:3]

    def test_caching_disabled(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler(enable_prefix_caching=False)
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 13))
        scheduler.add_request(make_request("bb", 13))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"a": 13, "bb": 13}
        assert scheduler.stats.prefix_cache_queries == 0

    def test_reset_prefix_cache(self, runner_factory: Callable) -> None:
        scheduler = make_scheduler()
        runner = runner_factory(scheduler)
        scheduler.add_request(make_request("a", 13, max_tokens=1))
        run_to_completion(scheduler, runner)
        scheduler.reset_prefix_cache()
        scheduler.add_request(make_request("bb", 13))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"bb": 13}


def test_stats(runner_factory: Callable) -> None:
    scheduler = make_scheduler(num_kv_blocks=16, max_num_seqs=1)
    runner = runner_factory(scheduler)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("bb", 8))
    step(scheduler, runner)
    stats = scheduler.stats
    assert (stats.num_running, stats.num_waiting, stats.num_preempted_total) == (1, 1, 0)
    assert stats.kv_cache_usage == pytest.approx(2 / 16)
    assert scheduler.get_num_unfinished_requests() == 2


class TestBackgroundTier:
    """Under the priority policy, the background tier runs on what the other tiers leave."""

    BACKGROUND = 3

    def test_foreground_work_holds_the_background_to_a_few_tokens_after_it(
        self, runner_factory: Callable
    ) -> None:
        scheduler = make_scheduler(
            policy="priority", max_num_seqs=32, num_kv_blocks=256, background_priority=self.BACKGROUND
        )
        runner = runner_factory(scheduler)
        for index in range(12):
            scheduler.add_request(make_request(f"bg{index}", 3, priority=self.BACKGROUND, max_tokens=30))
        output, _ = step(scheduler, runner)
        assert len(scheduled(output)) == 12  # alone, the background runs at full width
        step(scheduler, runner)
        scheduler.add_request(make_request("late-bg", 3, priority=self.BACKGROUND, max_tokens=30))
        scheduler.add_request(make_request("user", 20, priority=2, max_tokens=3))
        output, _ = step(scheduler, runner)
        batch = scheduled(output)
        assert batch["user"] == 20
        background = {rid: n for rid, n in batch.items() if rid != "user"}
        assert sum(background.values()) == 8 and "late-bg" not in background
        # The background's share goes round in admission order, and nobody loses blocks or tokens.
        assert list(background) == [f"bg{index}" for index in range(8)]
        assert output.preempted_request_ids == set()
        while "user" in scheduler.requests:
            output, _ = step(scheduler, runner)
            assert sum(n for r, n in scheduled(output).items() if r != "user") <= 8
        # Once the foreground is gone, the background is whole again, latecomer included.
        output, _ = step(scheduler, runner)
        assert len(scheduled(output)) == 13
        run_to_completion(scheduler, runner)
        assert_all_blocks_free(scheduler)

    def test_under_fcfs_the_background_steps_aside_for_later_foreground_requests(
        self, runner_factory: Callable
    ) -> None:
        """First come, first served among the others; the background still only takes what they leave."""
        scheduler = make_scheduler(max_num_seqs=32, num_kv_blocks=256, background_priority=self.BACKGROUND)
        runner = runner_factory(scheduler)
        for index in range(12):
            scheduler.add_request(make_request(f"bg{index}", 3, priority=self.BACKGROUND, max_tokens=30))
        step(scheduler, runner)
        scheduler.add_request(make_request("late-bg", 3, priority=self.BACKGROUND, arrival_time=1.0))
        scheduler.add_request(make_request("user", 20, priority=2, max_tokens=3, arrival_time=2.0))
        output, _ = step(scheduler, runner)
        batch = scheduled(output)
        assert batch["user"] == 20 and "late-bg" not in batch
        assert sum(n for rid, n in batch.items() if rid != "user") == 8
        run_to_completion(scheduler, runner)
        assert_all_blocks_free(scheduler)

    def test_alone_the_background_takes_a_bounded_share_of_each_step(self, runner_factory: Callable) -> None:
        """So that a request of another tier arriving waits for a short step, not a full 2048-token one."""
        scheduler = make_scheduler(
            policy="priority",
            max_num_batched_tokens=2048,
            max_model_len=512,
            num_kv_blocks=1024,
            background_priority=self.BACKGROUND,
        )
        runner = runner_factory(scheduler)
        for index in range(4):
            scheduler.add_request(make_request(f"bg{index}", 200, priority=self.BACKGROUND, max_tokens=2))
        first, _ = step(scheduler, runner)
        assert scheduled(first) == {"bg0": 200, "bg1": 56}
        assert run_to_completion(scheduler, runner).keys() == {f"bg{index}" for index in range(4)}
        assert_all_blocks_free(scheduler)
        # A foreground request alone is not bounded.
        scheduler.add_request(make_request("user", 400, priority=2, max_tokens=2))
        output, _ = step(scheduler, runner)
        assert scheduled(output) == {"user": 400}
