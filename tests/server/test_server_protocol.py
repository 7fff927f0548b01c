"""Pure pieces of the server: tiers, victim choice, request translation, error bodies."""

from __future__ import annotations

import pytest
from kvfleet.contract.precedence import QueuedRequest, choose_victim
from kvfleet.contract.tiers import parse_priority, tier_of
from kvfleet.runtime.server.errors import BadRequestError
from kvfleet.runtime.serving.errors import validation_error
from kvfleet.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest, template_messages


def test_tiers_and_integers() -> None:
    assert [parse_priority(name) for name in ("critical", "high", "standard", "batch")] == [0, 1, 2, 3]
    assert parse_priority(" Batch ") == 3
    assert parse_priority("2") == 2 and parse_priority(0) == 0 and parse_priority(3) == 3
    assert [tier_of(p) for p in (-10, 0, 1, 2, 3, 99)] == [
        "critical",
        "critical",
        "high",
        "standard",
        "batch",
        "batch",
    ]
    # Only the integers of the tiers: anything else would jump the most urgent tier or mean nothing.
    for bad in ("urgent", "", True, -1, 4, -(10**18), "7", "-4"):
        with pytest.raises(ValueError, match=r"tier name .* or an integer in \[0, 3\]"):
            parse_priority(bad)


def test_victim_is_the_newest_of_the_worst_tier_below_the_newcomer() -> None:
    queued = [
        QueuedRequest("old-batch", 3, 1.0),
        QueuedRequest("new-batch", 3, 2.0),
        QueuedRequest("standard", 2, 3.0),
    ]
    assert choose_victim(queued, 0) == "new-batch"
    assert choose_victim(queued, 2) == "new-batch"
    assert choose_victim(queued, 3) is None
    assert choose_victim(queued[2:], 1) == "standard"
    assert choose_victim([], 0) is None


def test_completion_request_to_sampling_params() -> None:
    request = CompletionRequest(
        prompt="hi", max_tokens=5, temperature=0.5, top_k=3, stop="x", logprobs=2, seed=1
    )
    params = request.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (5, 0.5, 3, ["x"])
    assert (params.logprobs, params.seed) == (2, 1)
    # Greedy, as in vLLM: no filter applies.
    greedy = CompletionRequest(prompt="hi", temperature=0, top_k=3, top_p=0.5, min_p=0.1).sampling_params()
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.min_p) == (0, 0, 1.0, 0.0)
    defaults = CompletionRequest(prompt="hi").sampling_params()
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.n) == (16, 1.0, 1.0, 1)
    with pytest.raises(BadRequestError) as caught:
        CompletionRequest(prompt="hi", top_p=0).sampling_params()
    assert caught.value.param == "top_p"
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


def test_chat_request_token_limits_and_logprobs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=messages).sampling_params().max_tokens is None
    both = ChatCompletionRequest(messages=messages, max_tokens=9, max_completion_tokens=4)
    assert both.sampling_params().max_tokens == 4
    assert ChatCompletionRequest(messages=messages, logprobs=True).sampling_params().logprobs == 0
    assert (
        ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=5).sampling_params().logprobs
        == 5
    )
    assert ChatCompletionRequest(messages=messages).sampling_params().logprobs is None
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}])
    # The parts reach the rendering, which gives them to the template as it takes them
    # (kvfleet.runtime.chat_content_format).
    assert template_messages(parts.messages) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 2}
    ]


def test_validation_errors_name_the_field() -> None:
    error = validation_error([{"type": "int_parsing", "loc": ("body", "n"), "msg": "Input should be an int"}])
    assert error.param == "n" and error.status_code == 400 and "n:" in error.message
    missing = validation_error([{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}])
    assert "missing required field 'messages'" in missing.message
