"""Optional API-key auth, checked before anything else reads the request: the key as a bearer token, or as
`x-api-key` (how Anthropic's clients send it); probes and metrics stay open so that Kubernetes and Prometheus
need no secret."""

from __future__ import annotations

import hmac

from kvfleet.contract.errors import INVALID_API_KEY_MESSAGE
from kvfleet.runtime.server.errors import AuthenticationError, error_response, route_path
from kvfleet.runtime.server.middleware import PROBE_PATHS
from starlette.types import ASGIApp, Receive, Scope, Send


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in PROBE_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = AuthenticationError(
            INVALID_API_KEY_MESSAGE,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response(error, scope)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            return hmac.compare_digest(token.strip(), self._expected)
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self._expected)
