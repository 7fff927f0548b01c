"""OpenAI-shaped errors (kvfleet.contract.errors) as the API server raises and answers them:
FastAPI's handlers for them, for the engine's errors and for bodies that do not validate. The routes of
Anthropic's Messages API answer the same errors in Anthropic's shape.

Every failure a handler can meet is one of these, so clients (the openai SDKs retry 408, 429 and 5xx on
their own) see the status they expect and never a bare 500 for bad input.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from kvfleet.contract.errors import (
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
    http_error,
)
from kvfleet.runtime.errors import EngineError
from kvfleet.runtime.serving.errors import from_engine_error, validation_error
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import Scope

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
    "install_error_handlers",
]

logger = logging.getLogger(__name__)


def error_response(error: OpenAIError, scope: Scope | None = None) -> JSONResponse:
    """The error as the route of `scope` answers it (OpenAI's shape where there is none)."""
    body = error.body_for(route_path(scope)) if scope is not None else error.body()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


def route_path(scope: Scope) -> str:
    """The request's path without the --root-path prefix, when a proxy has left it on (as routing reads
    it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class ClientDisconnectedError(Exception):
    """The client went away; nobody is left to answer."""


Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]


def install_error_handlers(app: FastAPI, log_error_stack: bool = False) -> None:
    """With `log_error_stack` (vLLM's --log-error-stack), every error answered is logged with the stack it
    was raised from (an unexpected one always is)."""
    handlers: list[tuple[type[Exception], Handler]] = [
        (OpenAIError, _openai_error),
        (EngineError, _engine_error),
        (RequestValidationError, _validation_error),
        (StarletteHTTPException, _http_error),
    ]
    for kind, handler in handlers:
        app.add_exception_handler(kind, _with_stack(handler) if log_error_stack else handler)
    app.add_exception_handler(Exception, _unexpected_error)


def _with_stack(handler: Handler) -> Handler:
    async def logged(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        logger.error(
            "%s %s answered %d", request.method, request.url.path, response.status_code, exc_info=exc
        )
        return response

    return logged


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc, request.scope)


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    return error_response(from_engine_error(exc), request.scope)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc.errors()), request.scope)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    response = error_response(http_error(exc.status_code, str(exc.detail)), request.scope)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    return error_response(InternalServerError(f"internal error: {type(exc).__name__}"), request.scope)
