"""Routes whose JSON body is held to json_depth's nesting limit before FastAPI parses it: a body nested a
thousand deep would fail its parse with RecursionError, and one a few hundred deep would pass it and break
the validators and templates that walk it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from kvfleet.runtime import json_depth
from kvfleet.runtime.server.errors import BadRequestError
from starlette.requests import Request
from starlette.responses import Response

# Bodies FastAPI reads as forms, not JSON (file uploads, whose lines the Batch API checks itself).
_FORM_TYPES = ("multipart/", "application/x-www-form-urlencoded")


class DepthCheckedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if _has_json_body(request):
                try:
                    # Read once: the handler gets the same bytes from the request's cache.
                    json_depth.check_text(await request.body())
                except json_depth.JSONTooDeepError as exc:
                    raise BadRequestError(f"the body is refused: {exc}") from None
            return await handle(request)

        return checked


def _has_json_body(request: Request) -> bool:
    return request.method == "POST" and not request.headers.get("content-type", "").startswith(_FORM_TYPES)
