"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status; on
the routes of Anthropic's Messages API, in its shape: `{"type": "error", "error": {"type", "message"}}`.

Free of any web framework, so that the fleet gateway (aiohttp) answers with the same errors as the API
server (FastAPI) and the OpenAI service; kvfleet.runtime.server.errors turns them into FastAPI's responses.
"""

from __future__ import annotations

import json
from typing import Any

# Seconds a shed or refused client should wait before trying again.
RETRY_AFTER_OVERLOADED_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5
# The code of a replica's 503 while its sleep mode holds it asleep: the fleet gateway wakes it for the
# request.
SLEEPING_CODE = "sleeping"
# OpenAI's code of a 400 for a prompt the context cannot hold.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Anthropic's Messages API, as vLLM serves it: its routes answer errors in Anthropic's shape.
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
MESSAGES_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})
# Anthropic's error types by HTTP status; any other is invalid_request_error below 500, else api_error.
_ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The error as Anthropic's Messages API writes it (and its stream's error event)."""
        fallback = "invalid_request_error" if self.status_code < 500 else "api_error"
        error_type = _ANTHROPIC_ERROR_TYPES.get(self.status_code, fallback)
        return {"type": "error", "error": {"type": error_type, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The body a route answers this error with: Anthropic's on the Messages API's, else OpenAI's."""
        return self.anthropic_body() if path in MESSAGES_PATHS else self.body()

    def to_sse(self) -> str:
        """The error as the last event of a stream that has already sent its 200 headers."""
        return f"data: {json.dumps(self.body())}\n\n"

    def to_messages_event(self) -> str:
        """The error as the last event of a Messages API stream that has already sent its 200 headers."""
        return f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n"

    def response_error(self) -> dict[str, Any]:
        """The fields of the Responses API's `error` event: OpenAI's, with kvfleet's code (or the type, where
        it has none)."""
        return {"code": self.code or self.error_type, "message": self.message, "param": self.param}

    def to_response_event(self, sequence_number: int) -> str:
        """The error as the last event of a Responses API stream that has already sent its 200 headers (no
        [DONE] follows, as none ends such a stream)."""
        event = {"type": "error", "sequence_number": sequence_number, **self.response_error()}
        return f"event: error\ndata: {json.dumps(event)}\n\n"


class BadRequestError(OpenAIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(OpenAIError):
    status_code = 401
    error_type = "authentication_error"


# What a request without the right bearer token is told, by a server and by the gateway alike.
INVALID_API_KEY_MESSAGE = (
    "invalid or missing API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`, as "
    "Anthropic's clients do)"
)


class PermissionDeniedError(OpenAIError):
    """The request is well formed but claims what clients may not have (openai.PermissionDeniedError)."""

    status_code = 403
    error_type = "permission_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="permission_denied")


class NotFoundError(OpenAIError):
    status_code = 404
    error_type = "invalid_request_error"


class RequestTimeoutError(OpenAIError):
    status_code = 408
    error_type = "timeout_error"


def header_timeout_response() -> bytes:
    """A whole HTTP/1.1 408 response, closing the connection, to write to the socket of a client whose
    request headers did not arrive in time (before there is a request to answer)."""
    body = json.dumps(
        RequestTimeoutError("the request headers did not arrive in time", code="header_timeout").body()
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class ConflictError(OpenAIError):
    """The object's state does not allow the operation (cancelling a finished batch, ...)."""

    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLargeError(OpenAIError):
    status_code = 413
    error_type = "invalid_request_error"


class OverloadedError(OpenAIError):
    """The waiting queue is full (or a higher tier took this request's place)."""

    status_code = 429
    error_type = "server_overloaded"

    def __init__(self, message: str, *, code: str = "overloaded") -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(RETRY_AFTER_OVERLOADED_S)})


class ServiceUnavailableError(OpenAIError):
    """Loading, draining, or the engine has stopped."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, code: str = "unavailable") -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


class GatewayTimeoutError(OpenAIError):
    """The fleet gateway's replica did not answer in time."""

    status_code = 504
    error_type = "timeout_error"


class InternalServerError(OpenAIError):
    status_code = 500
    error_type = "internal_error"


def http_error(status: int, message: str) -> OpenAIError:
    """An error that a web framework answers itself (no such route, a method not allowed, a request it cannot
    parse), in OpenAI's shape with the framework's status."""
    error_class = {404: NotFoundError, 408: RequestTimeoutError, 413: PayloadTooLargeError}.get(
        status, BadRequestError if status < 500 else InternalServerError
    )
    error = error_class(message)
    error.status_code = status
    return error
