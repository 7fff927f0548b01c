"""What the engine raises to its callers. It knows nothing of HTTP: the server maps each to an OpenAI error.

Errors about one request finish that request alone; EngineDeadError means the engine core is gone and
nothing more will be served.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's errors. `kind` names the class on the wire between processes."""

    kind = "internal"


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (bad token ids, too long, ...)."""

    kind = "invalid"


class GrammarTimeoutError(InvalidRequestError):
    """The request's grammar (JSON schema, regex, ...) took longer to compile than the engine allows."""

    kind = "grammar_timeout"


class InvalidContinuationError(InvalidRequestError):
    """A continuation's resumed output cannot be continued: its tokens do not follow the request's grammar,
    or the request would already have stopped on one of them."""

    kind = "invalid_continuation"


class EngineOverloadedError(EngineError):
    """The waiting queue is full, and nothing of a lower tier could give way."""

    kind = "overloaded"


class RequestShedError(EngineOverloadedError):
    """A request of a higher tier took this request's place in the waiting queue."""

    kind = "shed"


# The engine options vLLM's queue limits are set by, which name the limit a QueueLimitError met.
QUEUE_LIMITS = ("max_num_queued_reqs", "max_num_queued_tokens")


class QueueLimitError(EngineError):
    """vLLM's queue limits: admitting the request would take this API server past one of them, named by
    `limit` (the engine option's name). Raised where requests are admitted, never sent between processes."""

    kind = "queue_limit"

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class RequestFailedError(EngineError):
    """The engine failed while running this request; the others go on."""

    kind = "failed"


class EngineNotReadyError(EngineError):
    """The engine did not become ready in time for this request."""

    kind = "not_ready"


class EngineShutdownError(EngineError):
    """The engine is shutting down; the request was stopped before it finished."""

    kind = "shutdown"


class EngineSleepingError(EngineError):
    """The engine is asleep (sleep mode), or falling asleep: nothing runs until it is woken up."""

    kind = "sleeping"


class EngineDeadError(EngineError):
    """The engine core process has died or could not start; nothing more can be served."""

    kind = "dead"


_BY_KIND: dict[str, type[EngineError]] = {
    cls.kind: cls
    for cls in (
        EngineError,
        InvalidRequestError,
        InvalidContinuationError,
        GrammarTimeoutError,
        EngineOverloadedError,
        RequestShedError,
        RequestFailedError,
        EngineNotReadyError,
        EngineShutdownError,
        EngineSleepingError,
        EngineDeadError,
    )
}


def error_of_kind(kind: str, message: str) -> EngineError:
    """Rebuild an error sent by the engine core process."""
    return _BY_KIND.get(kind, EngineError)(message)
