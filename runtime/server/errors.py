"""OpenAI-shaped errors (kvfleet.runtime.server.openai_errors) as the API server raises and answers them.

Every failure a handler can meet is one of these, so clients (the openai SDKs retry 408, 429 and 5xx on
their own) see the status they expect and never a bare 500 for bad input.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from kvfleet.runtime.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineShutdownError,
    GrammarTimeoutError,
    InvalidRequestError,
    RequestShedError,
)
from kvfleet.runtime.server.openai_errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    OpenAIError,
    OverloadedError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

# The error classes are imported from here by the server's modules.
__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ClientDisconnectedError",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "OpenAIError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RequestTimeoutError",
    "ServiceUnavailableError",
    "from_engine_error",
    "install_error_handlers",
    "validation_error",
]

logger = logging.getLogger(__name__)


class ClientDisconnectedError(Exception):
    """The client went away; nobody is left to answer."""


def from_engine_error(error: EngineError) -> OpenAIError:
    """The OpenAI error a client sees for an error of the engine."""
    message = str(error)
    if isinstance(error, GrammarTimeoutError):
        return BadRequestError(message, code="grammar_compile_timeout")
    if isinstance(error, InvalidRequestError):
        return BadRequestError(message)
    if isinstance(error, RequestShedError):
        return OverloadedError(message, code="shed")
    if isinstance(error, EngineOverloadedError):
        return OverloadedError(message)
    if isinstance(error, EngineNotReadyError):
        return ServiceUnavailableError(message, code="not_ready")
    if isinstance(error, EngineShutdownError):
        return ServiceUnavailableError(message, code="shutting_down")
    if isinstance(error, EngineDeadError):
        return InternalServerError(message, code="engine_dead")
    return InternalServerError(message)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.to_response()


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    return from_engine_error(exc).to_response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).to_response()


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


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error_class = {404: NotFoundError, 408: RequestTimeoutError, 413: PayloadTooLargeError}.get(
        exc.status_code, BadRequestError
    )
    error = error_class(str(exc.detail))
    response = error.to_response()
    response.status_code = exc.status_code
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    return InternalServerError(f"internal error: {type(exc).__name__}").to_response()
