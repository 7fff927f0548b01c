from __future__ import annotations

import itertools

import pytest
from kvfleet.runtime.request import FinishReason, InvalidStateTransition, Request, RequestStatus
from kvfleet.runtime.sampling_params import SamplingParams

FINISHED = [status for status in RequestStatus if RequestStatus.is_finished(status)]
UNFINISHED = [
    RequestStatus.WAITING,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
]
LEGAL = {
    (RequestStatus.WAITING, RequestStatus.RUNNING),
    (RequestStatus.RUNNING, RequestStatus.PREEMPTED),
    (RequestStatus.PREEMPTED, RequestStatus.RUNNING),
    # Disaggregated prefill and decode: a decode call waits for its prompt's KV, then runs, or computes it.
    (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS),
    (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING),
    (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING),
} | {(before, after) for before in UNFINISHED for after in FINISHED}


def make(status: RequestStatus = RequestStatus.WAITING) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(stop_token_ids=[9]), eos_token_id=2, arrival_time=5.0)
    request.status = status
    return request


def test_new_request_fields() -> None:
    request = make()
    assert request.status == RequestStatus.WAITING
    assert request.num_tokens == request.num_prompt_tokens == 3
    assert request.num_output_tokens == 0
    assert request.num_computed_tokens == 0
    assert request.num_cached_tokens == -1
    assert request.num_preemptions == 0
    assert request.block_hashes == []
    assert request.arrival_time == 5.0
    assert request.priority == 0
    assert request.deadline is None
    assert request.stop_reason is None
    assert request.finish_reason is None
    assert not request.is_finished
    assert request.stop_token_id_set == {9}


def test_arrival_time_defaults_to_monotonic_now() -> None:
    import time

    before = time.monotonic()
    request = Request("r", [1], SamplingParams())
    assert before <= request.arrival_time <= time.monotonic()


def test_prompt_is_copied_and_empty_prompt_rejected() -> None:
    prompt = [1, 2]
    request = Request("r", prompt, SamplingParams())
    prompt.append(3)
    assert request.prompt_token_ids == [1, 2]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())


def test_append_output_token_ids() -> None:
    request = make()
    request.append_output_token_ids(7)
    request.append_output_token_ids([8, 9])
    assert request.output_token_ids == [7, 8, 9]
    assert request.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert request.prompt_token_ids == [1, 2, 3]
    assert (request.num_tokens, request.num_output_tokens) == (6, 3)


@pytest.mark.parametrize(("before", "after"), sorted(LEGAL))
def test_legal_transitions(before: RequestStatus, after: RequestStatus) -> None:
    request = make(before)
    request.transition(after)
    assert request.status == after
    assert request.is_finished == RequestStatus.is_finished(after)


@pytest.mark.parametrize(
    ("before", "after"),
    sorted(set(itertools.product(RequestStatus, RequestStatus)) - LEGAL),
)
def test_illegal_transitions_raise(before: RequestStatus, after: RequestStatus) -> None:
    request = make(before)
    with pytest.raises(InvalidStateTransition, match=f"from {before.name} to {after.name}$"):
        request.transition(after)
    assert request.status == before


def test_finish_reasons() -> None:
    expected = {
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_TIMED_OUT: FinishReason.TIMEOUT,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    }
    for status in RequestStatus:
        assert make(status).finish_reason == expected.get(status)
    assert FinishReason.STOP == "stop"
    assert FinishReason("timeout") is FinishReason.TIMEOUT


def test_is_finished_static() -> None:
    assert [RequestStatus.is_finished(status) for status in UNFINISHED] == [False] * 4
    assert all(RequestStatus.is_finished(status) for status in FINISHED)
    assert len(FINISHED) == 5
