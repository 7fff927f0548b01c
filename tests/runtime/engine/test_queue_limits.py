"""vLLM's queue limits as an API server applies them, on counts given by hand: the sequences limit counts the
request's n, the token limit refuses once the backlog has reached it, several API servers split a limit, and
a negative limit is refused with the option's name."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.queue_limits import QueueLimits
from kvfleet.runtime.errors import QueueLimitError


def _refused_by(limits: QueueLimits, num_sequences: int, num_queued_tokens: int, n: int) -> str | None:
    try:
        limits.check(num_sequences, num_queued_tokens, n)
    except QueueLimitError as error:
        return error.limit
    return None


def test_each_limit_refuses_past_it_and_not_at_it() -> None:
    limits = QueueLimits(max_num_queued_reqs=4, max_num_queued_tokens=100)
    assert _refused_by(limits, 3, 0, 1) is None  # the fourth sequence fits
    assert _refused_by(limits, 3, 0, 2) == "max_num_queued_reqs"  # two sequences do not
    assert _refused_by(limits, 0, 99, 1) is None  # the backlog is under the limit, however long the prompt
    assert _refused_by(limits, 0, 100, 1) == "max_num_queued_tokens"
    assert _refused_by(limits, 4, 100, 1) == "max_num_queued_reqs"  # the sequences limit is checked first
    only_tokens = QueueLimits(max_num_queued_reqs=None, max_num_queued_tokens=0)
    assert _refused_by(only_tokens, 1000, 0, 8) == "max_num_queued_tokens"  # vLLM's 0: nothing is admitted


@pytest.mark.parametrize(
    ("limits", "servers", "shares"),
    [
        ((10, None), 1, [(10, None)]),
        ((10, 7), 3, [(4, 3), (3, 2), (3, 2)]),
        ((1, None), 2, [(1, None), (0, None)]),
    ],
)
def test_api_servers_split_each_limit(
    tiny_llama: Path, limits: tuple[int, int | None], servers: int, shares: list[tuple[int, int | None]]
) -> None:
    config = EngineConfig(
        model=str(tiny_llama), max_num_queued_reqs=limits[0], max_num_queued_tokens=limits[1]
    )
    assert [QueueLimits.share(config, servers, index) for index in range(servers)] == [
        QueueLimits(*share) for share in shares
    ]
    assert QueueLimits.share(EngineConfig(model=str(tiny_llama)), 2, 0) is None


@pytest.mark.parametrize("name", ["max_num_queued_reqs", "max_num_queued_tokens"])
def test_a_negative_limit_is_refused_by_name(tiny_llama: Path, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be 0 or more"):
        EngineConfig(model=str(tiny_llama), **{name: -1})
