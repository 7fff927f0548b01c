"""The gateway's HTTP side: an aiohttp server in front of an aiohttp client pool.

Completion requests are parsed (model, tier, prompt) before anything else, queued in their model's pool,
and sent to the chosen replica with the body and headers unchanged. The response streams back chunk by chunk
as the replica writes it, so SSE arrives unbuffered. A connection error or a 503 is retried on another
replica as long as nothing has been sent to the client; after that a failure ends the stream (with an error
event when it is SSE). A client that disconnects cancels its handler (handler_cancellation), which closes
the upstream connection, and the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web
from kvfleet.gateway.adapters import DEFAULT_ADAPTER_POLL_SECONDS, poll_adapters
from kvfleet.gateway.discovery import Discovery, ModelConfig
from kvfleet.gateway.flow import DEFAULT_MAX_QUEUE, Fleet, ModelPool
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.requests import CHAT_PATH, COMPLETIONS_PATH, RoutedRequest, parse_request
from kvfleet.runtime.server.openai_errors import (
    INVALID_API_KEY_MESSAGE,
    AuthenticationError,
    NotFoundError,
    OpenAIError,
    PayloadTooLargeError,
    ServiceUnavailableError,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_ATTEMPTS = 3
# The request line and each header line at most, and how many headers; past them aiohttp answers 400/431.
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
# A body of known length up to this size is read whole and sent in one write; larger ones and SSE stream.
WHOLE_BODY_BYTES = 256 * 1024
CONNECT_TIMEOUT_S = 5.0
# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), and the ones aiohttp sets itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class Gateway:
    """The application and what its handlers share."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        adapter_poll_seconds: float = DEFAULT_ADAPTER_POLL_SECONDS,
        bare_name_namespace: str | None = None,
    ) -> None:
        self.discovery = discovery
        self.adapter_poll_seconds = adapter_poll_seconds
        self.metrics = GatewayMetrics()
        self.fleet = Fleet(max_queue, self.metrics, bare_name_namespace)
        self.max_attempts = max_attempts
        self.max_body_bytes = max_body_bytes
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_post(CHAT_PATH, self.completion)
        self.app.router.add_post(COMPLETIONS_PATH, self.completion)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.prometheus)
        self.app.cleanup_ctx.append(self._lifetime)

    async def start(self, host: str, port: int) -> web.AppRunner:
        """Serves on host:port until the returned runner is cleaned up."""
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            max_line_size=MAX_HEADER_BYTES,
            max_field_size=MAX_HEADER_BYTES,
            max_headers=MAX_HEADERS,
        )
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        # No connection limit of its own: the in-flight cap per replica bounds the connections. Bodies pass
        # through as the replica encoded them.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
        )
        watchers = [
            asyncio.create_task(self.discovery.run(self.fleet.update), name="kvfleet-gateway-discovery"),
            asyncio.create_task(
                poll_adapters(self.fleet, self.session, self.adapter_poll_seconds),
                name="kvfleet-gateway-adapters",
            ),
        ]
        try:
            yield
        finally:
            for watcher in watchers:
                watcher.cancel()
            for watcher in watchers:
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def models(self, request: web.Request) -> web.Response:
        """The models this request's key may use (see `_may_use`). An adapter's card names its base model as
        `parent`, as a replica's own /v1/models does."""
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kvfleet",
                "parent": pool.config.adapter_of,
            }
            for name, pool in sorted(self.fleet.pools.items())
            if _may_use(request.headers, pool.config)
        ]
        return web.json_response({"object": "list", "data": data})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        # Refused requests count under the model only once it is known to exist: no unbounded label values.
        model_label = ""
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise PayloadTooLargeError(
                    f"the request body is larger than the gateway's limit of {self.max_body_bytes} bytes",
                    code="request_too_large",
                ) from None
            routed = parse_request(request.path, body, request.headers)
            pool = self.fleet.resolve(routed.model)
            if pool is None:
                raise NotFoundError(
                    f"the model {routed.model!r} does not exist", param="model", code="model_not_found"
                )
            model_label = pool.config.name
            _authenticate(request.headers, pool.config)
            response = await self._forward(request, body, routed, pool)
        except OpenAIError as error:
            self.metrics.requests.labels(model_label, str(error.status_code)).inc()
            return _error_response(error)
        self.metrics.requests.labels(model_label, str(response.status)).inc()
        return response

    async def _forward(
        self, request: web.Request, body: bytes, routed: RoutedRequest, pool: ModelPool
    ) -> web.StreamResponse:
        assert self.session is not None, "the session lives as long as the app"
        model, config = pool.config.name, pool.config
        priority = routed.priority if routed.priority is not None else config.default_priority
        headers = _for_replicas_of(config, _forward_headers(request.headers))
        body = _renamed_for_replicas(config, routed, body)
        arrived = time.monotonic()
        from_zero = not pool.replicas
        tried: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            replica = await pool.acquire(priority, routed.prompt_text, tried, routed.deadline_seconds)
            if attempt == 1:
                self.metrics.queue_wait.labels(model).observe(time.monotonic() - arrived)
            self.metrics.routing_decisions.labels(model, pool.config.policy, replica.url).inc()
            sent = time.monotonic()
            try:
                upstream = await self.session.post(f"{replica.url}{request.path}", data=body, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as error:
                pool.release(replica, priority)
                tried.append(replica.url)
                self.metrics.retries.labels(model, "connection_error").inc()
                logger.info(
                    "%s: %s failed before answering (%s); trying another replica", model, replica.url, error
                )
                continue
            except BaseException:
                pool.release(replica, priority)  # the client left while the replica had not answered yet
                raise
            try:
                self.metrics.upstream_latency.labels(model).observe(time.monotonic() - sent)
                if upstream.status == 503 and attempt < self.max_attempts:
                    tried.append(replica.url)
                    self.metrics.retries.labels(model, "unavailable").inc()
                    continue
                if from_zero:
                    self.metrics.activation.labels(model).observe(time.monotonic() - arrived)
                return await _relay(request, upstream, model)
            finally:
                # A response read to its end leaves a connection to reuse; any other is closed, which is
                # how a replica learns that its client left.
                if upstream.content.at_eof():
                    upstream.release()
                else:
                    upstream.close()
                pool.release(replica, priority)
        raise ServiceUnavailableError(
            f"every replica of model {model!r} tried ({self.max_attempts} attempts) failed before answering",
            code="upstream_unavailable",
        )


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse, model: str) -> web.StreamResponse:
    """The replica's response, streamed to the client as it arrives; a small whole body (a non-streamed
    completion, which a replica sends only once it is done) goes out in one piece."""
    headers = [(name, value) for name, value in upstream.headers.items() if name.lower() not in _HOP_BY_HOP]
    event_stream = upstream.content_type == "text/event-stream"
    length = upstream.content_length
    if not event_stream and length is not None and length <= WHOLE_BODY_BYTES:
        try:
            body = await upstream.read()
        except aiohttp.ClientError as error:
            raise ServiceUnavailableError(
                f"the replica serving model {model!r} failed mid-response: {error}",
                code="upstream_failed",
            ) from None
        return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    if length is not None:
        response.content_length = length
    await response.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
    except aiohttp.ClientError as error:
        logger.warning("%s: the replica failed mid-response: %s", model, error)
        if not event_stream:
            # A plain body cut short must not look complete: drop the connection instead of ending it.
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write(
            ServiceUnavailableError(
                f"the replica serving model {model!r} failed mid-stream", code="upstream_failed"
            )
            .to_sse()
            .encode()
        )
    await response.write_eof()
    return response


def _authenticate(headers: Mapping[str, str], config: ModelConfig) -> None:
    """Checks the client's key against the service the request is routed to before the request is queued or
    wakes anything (the replica checks it again)."""
    key = config.client_key
    if key is None:
        return
    if key.sha256 is None:
        raise ServiceUnavailableError(
            f"the gateway cannot read the API key of model {config.name!r} from its Secret",
            code="api_key_unavailable",
        )
    if not _presents(headers, key.sha256):
        raise AuthenticationError(
            INVALID_API_KEY_MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )


def _presents(headers: Mapping[str, str], key_sha256: bytes) -> bool:
    """Whether the request carries the key as a bearer token."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    presented = hashlib.sha256(token.strip().encode()).digest()
    return scheme.lower() == "bearer" and hmac.compare_digest(presented, key_sha256)


def _may_use(headers: Mapping[str, str], config: ModelConfig) -> bool:
    """Whether a request with these headers may use the model, for /v1/models: a model needing no key, or
    one whose key the request carries. A model whose key cannot be read is shown to no one."""
    key = config.client_key
    return key is None or (key.sha256 is not None and _presents(headers, key.sha256))


def _for_replicas_of(config: ModelConfig, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers without the client's Authorization where the model's replicas are not to get it: a key
    reaches only the service it was checked for (`_authenticate` ran before)."""
    if config.forward_authorization:
        return headers
    return [(name, value) for name, value in headers if name.lower() != "authorization"]


def _renamed_for_replicas(config: ModelConfig, routed: RoutedRequest, body: bytes) -> bytes:
    """The body with `model` as the replicas know it (`team-prod/llama-8b` is `llama-8b` there)."""
    if routed.model == config.upstream_name:
        return body
    # Compact and in UTF-8, so the body does not outgrow what the client sent by more than the name.
    renamed = {**routed.payload, "model": config.upstream_name}
    return json.dumps(renamed, ensure_ascii=False, separators=(",", ":")).encode()


def _error_response(error: OpenAIError) -> web.Response:
    return web.json_response(error.body(), status=error.status_code, headers=error.headers)


def _forward_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(name, value) for name, value in headers.items() if name.lower() not in _HOP_BY_HOP]
