from __future__ import annotations

import math
from typing import Any

import pytest
from kvfleet.runtime.sampling_params import SamplingParams


def test_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.seed is None
    assert params.logprobs is None
    assert params.stop == []
    assert params.stop_token_ids == []
    assert not params.ignore_eos
    assert not params.include_stop_str_in_output
    assert params.skip_special_tokens
    assert not params.greedy


def test_normalises_stop_and_top_k() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_greedy_means_temperature_below_vllms_epsilon() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-50).greedy
    assert SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_accepts_edges_of_ranges() -> None:
    SamplingParams(
        top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=20, max_tokens=None
    )
    SamplingParams(logprobs=0, min_tokens=16, max_tokens=16, seed=-3)
    SamplingParams(max_tokens=None, min_tokens=1000)
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=2**63 - 4, n=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("n", 0),
        ("n", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("min_tokens", -1),
        ("seed", "7"),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("temperature", math.inf),
        ("top_p", -math.inf),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
    ],
)
def test_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_seed_covers_every_sequence_of_n() -> None:
    # Sequence i of n is seeded with seed + i: the last one must still fit a torch generator.
    with pytest.raises(ValueError, match=r"^seed .*n=4"):
        SamplingParams(seed=2**63 - 3, n=4)


def test_rejects_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"^min_tokens .*max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)
