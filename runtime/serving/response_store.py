"""The responses a server keeps for `previous_response_id` and GET /v1/responses/{id}: in memory, the most
recent ones only. Each entry is bounded by the context (its conversation had to fit in it), so bounding
their number bounds the memory they take."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    # The response body, as it was answered.
    body: dict[str, Any]
    # The conversation up to and including the response's output, as chat messages, without the
    # instructions (which a follow-up gives afresh).
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        if max_responses < 1:
            raise ValueError(f"a response store holds at least one response, not {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keeps the response, dropping the least recently used one beyond the bound."""
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def __contains__(self, response_id: object) -> bool:
        """Whether the response is kept, without making it the most recently used."""
        return response_id in self._responses

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
