"""vLLM's queue limits (max_num_queued_reqs, max_num_queued_tokens): valves an API server closes before its
queue grows without bound. A request past one fails at once, for a load balancer or the fleet gateway to try
another replica, instead of waiting behind a queue that would miss its latency target.

Each API server counts what it holds itself, exactly and at once (the engine core's counts arrive a step
late), so several servers in front of one engine each take their share of a limit."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.errors import QUEUE_LIMITS, QueueLimitError

_REQUESTS_LIMIT, _TOKENS_LIMIT = QUEUE_LIMITS


@dataclass(frozen=True)
class QueueLimits:
    # Unfinished sequences (a request of n counts n); None: no limit.
    max_num_queued_reqs: int | None
    # Prompt tokens of the requests that have had no output yet; None: no limit.
    max_num_queued_tokens: int | None

    @classmethod
    def share(cls, config: EngineConfig, api_server_count: int, client_index: int) -> QueueLimits | None:
        """One API server's part of the engine's limits, the remainder going to the first servers; None
        without limits."""

        def part(limit: int | None) -> int | None:
            if limit is None:
                return None
            return limit // api_server_count + (client_index < limit % api_server_count)

        if config.max_num_queued_reqs is None and config.max_num_queued_tokens is None:
            return None
        return cls(part(config.max_num_queued_reqs), part(config.max_num_queued_tokens))

    def check(self, num_sequences: int, num_queued_tokens: int, n: int) -> None:
        """Raises QueueLimitError if a request of n sequences cannot be admitted beside `num_sequences`
        unfinished ones and `num_queued_tokens` prompt tokens waiting for their first output."""
        limit = self.max_num_queued_reqs
        if limit is not None and num_sequences + n > limit:
            raise QueueLimitError(
                f"this server holds {num_sequences} unfinished sequences and admits at most {limit} "
                f"({_REQUESTS_LIMIT}): retry later or on another replica",
                _REQUESTS_LIMIT,
            )
        limit = self.max_num_queued_tokens
        if limit is not None and num_queued_tokens >= limit:
            raise QueueLimitError(
                f"the prompts waiting for their first token on this server hold {num_queued_tokens} tokens, "
                f"its limit being {limit} ({_TOKENS_LIMIT}): retry later or on another replica",
                _TOKENS_LIMIT,
            )
