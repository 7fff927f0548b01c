"""The OpenAI errors the service answers with for what the engine raises and for a body that does not
validate; the error classes themselves are kvfleet.contract.errors'."""

from __future__ import annotations

from typing import Any

from kvfleet.contract.errors import (
    SLEEPING_CODE,
    BadRequestError,
    InternalServerError,
    OpenAIError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvfleet.contract.resume import CONTINUATION
from kvfleet.runtime.errors import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineSleepingError,
    GrammarTimeoutError,
    InvalidContinuationError,
    InvalidRequestError,
    QueueLimitError,
    RequestShedError,
)


def from_engine_error(error: EngineError) -> OpenAIError:
    """The OpenAI error a client sees for an error of the engine."""
    message = str(error)
    if isinstance(error, GrammarTimeoutError):
        return BadRequestError(message, code="grammar_compile_timeout")
    if isinstance(error, InvalidContinuationError):
        return BadRequestError(message, param=CONTINUATION)
    if isinstance(error, InvalidRequestError):
        return BadRequestError(message)
    if isinstance(error, RequestShedError):
        return OverloadedError(message, code="shed")
    if isinstance(error, EngineOverloadedError):
        return OverloadedError(message)
    if isinstance(error, QueueLimitError):
        return ServiceUnavailableError(message, code=error.limit)
    if isinstance(error, EngineNotReadyError):
        return ServiceUnavailableError(message, code="not_ready")
    if isinstance(error, EngineShutdownError):
        return ServiceUnavailableError(message, code="shutting_down")
    if isinstance(error, EngineSleepingError):
        return ServiceUnavailableError(message, code=SLEEPING_CODE)
    if isinstance(error, EngineDeadError):
        return InternalServerError(message, code="engine_dead")
    return InternalServerError(message)


def validation_error(errors: Any) -> BadRequestError:
    """Pydantic's error list -> one readable message naming the bad field.

    A field that takes several shapes (a prompt is text, texts, token ids or lists of token ids) fails once
    per shape; the message reports the shapes that got furthest, under the field's own name.
    """
    errors = list(errors)
    if not errors:
        return BadRequestError("invalid request body")
    if errors[0].get("type") == "json_invalid":
        return BadRequestError(
            f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}"
        )
    located = [(_field_path(error), error) for error in errors]
    deepest = max(len(path) for path, _ in located)
    path, first = next((path, error) for path, error in located if len(path) == deepest)
    param = ".".join(path) or None
    if first.get("type") == "missing":
        message = f"missing required field {param!r}" if param else "the request body is missing"
    else:
        reasons = " or ".join(dict.fromkeys(error["msg"] for where, error in located if where == path))
        message = f"{param}: {reasons}" if param else reasons
    other_fields = {where[:1] for where, _ in located} - {path[:1]}
    if other_fields:
        message += f" (and {len(other_fields)} more field{'s' if len(other_fields) > 1 else ''})"
    return BadRequestError(message, param=param)


# What pydantic calls the members of a union in an error's location ('str', 'list[int]', 'TextPart', ...).
_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "none"})


def _field_path(error: dict[str, Any]) -> tuple[str, ...]:
    """The error's location as the client wrote the field: without "body" and union members' names."""
    return tuple(
        str(part)
        for part in error.get("loc", ())
        if part != "body"
        and not (
            isinstance(part, str)
            and (part in _UNION_MEMBER_NAMES or part[:1].isupper() or any(c in part for c in "[]-"))
        )
    )
