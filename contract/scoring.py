"""The fields of vLLM's /score that hold the two sides of its pairs: the runtime scores them, the gateway
routes on the first."""

from __future__ import annotations

from collections.abc import Collection

from kvfleet.contract.errors import BadRequestError

# Each pair of names vLLM takes, first side and second.
SCORE_SIDES: tuple[tuple[str, str], ...] = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
_NAMES = sorted({name for pair in SCORE_SIDES for name in pair})


def score_sides(given: Collection[str]) -> tuple[str, str]:
    """The pair of fields a /score body holds its texts in, from the fields it gives (with a value): exactly
    one pair, or a 400."""
    named = set(given).intersection(_NAMES)
    for pair in SCORE_SIDES:
        if named == set(pair):
            return pair
    raise BadRequestError(
        "give the texts to score in one pair of fields: queries and documents, queries and items, data_1 and "
        "data_2, or text_1 and text_2",
        param=min(named) if named else "queries",
    )
