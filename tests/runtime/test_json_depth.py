from __future__ import annotations

import json
import random
from typing import Any

import pytest
from kvfleet.runtime.json_depth import MAX_JSON_DEPTH, JSONTooDeepError, check_text


def _depth(value: Any) -> int:
    """How deep arrays and objects nest, by recursion over the parsed value (the documents here are shallow
    enough for it)."""
    if isinstance(value, dict):
        return 1 + max((_depth(item) for item in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(item) for item in value), default=0)
    return 0


def _document(rng: random.Random, depth: int) -> Any:
    """A value nested exactly `depth` deep, with shallow siblings (brackets that do not add depth) and
    brackets inside strings."""
    if depth == 0:
        return rng.choice([1, "[[{", "]}", None, "plain"])
    inner = _document(rng, depth - 1)
    # Empty arrays and objects one level down, where the chain goes deeper anyway.
    siblings: list[Any] = ["[{", 2]
    if depth >= 2:
        siblings += [[] for _ in range(rng.randrange(3))] + [{} for _ in range(rng.randrange(2))]
    if rng.random() < 0.5:
        return {"deeper": inner, **{f"s{index}": item for index, item in enumerate(siblings)}}
    return [*siblings, inner]


@pytest.mark.parametrize("as_bytes", [False, True])
def test_the_limit_is_refused_one_level_past_it_whatever_brackets_surround_it(as_bytes: bool) -> None:
    rng = random.Random(0)
    for depth in [1, 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, MAX_JSON_DEPTH + 5, 300]:
        for _ in range(5):
            text = json.dumps(_document(rng, depth))
            assert _depth(json.loads(text)) == depth
            document: str | bytes = text.encode() if as_bytes else text
            if depth > MAX_JSON_DEPTH:
                with pytest.raises(JSONTooDeepError):
                    check_text(document)
            else:
                check_text(document)


def test_brackets_that_do_not_nest_pass_however_many() -> None:
    # Far more brackets than levels: a wide array of shallow ones, and brackets inside a long string.
    check_text(json.dumps([[index] for index in range(10_000)]))
    check_text(json.dumps({"prompt": "[" * 100_000 + "{" * 100_000}))


def test_a_truncated_document_counts_its_open_brackets() -> None:
    # Nothing closes, so every bracket is a level: 64 pass on the quick count, 65 go on to the scan.
    check_text("[" * MAX_JSON_DEPTH)
    with pytest.raises(JSONTooDeepError):
        check_text("[" * (MAX_JSON_DEPTH + 1))
