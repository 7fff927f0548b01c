"""Every error the gateway answers itself, in OpenAI's shape (kvfleet.contract.errors; Anthropic's on the
Messages API's routes), as a replica answers them: its own refusals, and those aiohttp would answer in plain
text (no such route, a method not allowed, a request it cannot parse, a handler that failed). The official
SDKs then raise their typed errors with the message."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler
from kvfleet.contract.errors import OpenAIError, http_error


def error_response(error: OpenAIError, path: str = "") -> web.Response:
    """The error as the route at `path` answers it."""
    response = web.json_response(error.body_for(path), status=error.status_code, headers=error.headers)
    if error.headers.get("Connection") == "close":
        response.force_close()
    return response


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's router refusals (404, 405) as OpenAI errors; a 405 keeps its Allow header."""
    try:
        return await handler(request)
    except web.HTTPException as refusal:
        if refusal.status < 400:
            raise
        error = http_error(refusal.status, _message(request, refusal))
        if "Allow" in refusal.headers:
            error.headers["Allow"] = refusal.headers["Allow"]
        return error_response(error, request.path)


def _message(request: web.Request, refusal: web.HTTPException) -> str:
    if isinstance(refusal, web.HTTPNotFound):
        return f"the gateway serves no {request.method} {request.path}"
    if isinstance(refusal, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(refusal.allowed_methods))
        return f"{request.method} is not allowed on {request.path} (allowed: {allowed})"
    return refusal.text or refusal.reason
