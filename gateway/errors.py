"""The gateway's own refusals, in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

The runtime's errors module is bound to FastAPI; the gateway answers through aiohttp, so it builds the same
shape here.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

# Seconds a refused client should wait before trying again: a queue drains fast, a replica starts slowly.
RETRY_AFTER_OVERLOADED_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5


class GatewayError(Exception):
    status = 500
    error_type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.json_response(self.body(), status=self.status, headers=headers)

    def sse_event(self) -> bytes:
        """The error as the last event of a stream whose 200 headers are already sent."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


class BadRequestError(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class NotFoundError(GatewayError):
    status = 404
    error_type = "not_found_error"


class PayloadTooLargeError(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class OverloadedError(GatewayError):
    """The model's queue is full, the request was shed for a more urgent one, or its deadline passed."""

    status = 429
    error_type = "rate_limit_error"


class UnavailableError(GatewayError):
    """No replica of the model became ready within the hold time, or every replica tried failed."""

    status = 503
    error_type = "service_unavailable"
