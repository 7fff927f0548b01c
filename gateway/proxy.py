"""The gateway's HTTP side: an aiohttp server in front of an aiohttp client pool.

Requests to a model (every OpenAI endpoint a replica serves on one: kvfleet.gateway.requests) are parsed
(model, tier, prompt) before anything else, queued in their model's pool, and sent to the chosen replica with
the body and headers unchanged. The response streams back chunk by chunk as the replica writes it, so SSE
arrives unbuffered. A connection error or a 503 is retried on another replica as long as nothing has been sent
to the client; after that a failure ends the stream (with an error event when it is SSE). A 503 that says the
replica is draining (the client has had nothing of the request: it came after the replica was told to stop, or
the drain ended while it was still there) is retried without counting as an attempt, and the replica is passed
over by every request for a while (kvfleet.gateway.routing.DRAIN_MEMORY_S), by when discovery has taken it out
of the fleet. Completions and chat completions are the exception: they are asked of a replica as a stream with
token ids, and one that fails mid-stream is resumed on another from the tokens already sent
(kvfleet.gateway.resumption). A client that disconnects cancels its handler (handler_cancellation), which
closes the upstream connection, and the replica aborts the request. Whatever the gateway answers itself is an
OpenAI error (kvfleet.gateway.http_errors).

Each request is named by one X-Request-Id (kvfleet.contract.request_ids), the client's or a new one: every
replica it reaches is sent it (a prefill replica and a decode replica, a retry, a resumed stream), so that
their answers' ids and logs name it alike, and the gateway's answer carries it.

A model whose policy routes on KV block hashes has each prompt tokenized and hashed as its replicas' engines
do (kvfleet.gateway.prompt_blocks), on a worker thread, once the model's tokenizer is at hand
(kvfleet.gateway.model_tokenizers).

Nothing waits without a deadline. A client has the header, body and send timeouts of
kvfleet.gateway.http_protocol; a body is read only from a client that presents a key of the fleet (unless a
model needs none), up to its size limit and within a budget shared by every body held at once. A replica
has deadlines to connect, to answer, to send each chunk of its body and to finish it (UpstreamTimeouts).

A model with prefill replicas (disaggregated prefill and decode, vLLM's protocol: see
kvfleet.contract.kv_transfer) routes a request to a decode replica first, as any other. When the prompt's new
tokens there (its length less the prefix that replica is taken to cache, estimated from characters: the
gateway does not tokenize) reach the model's threshold, a prefill replica computes the prompt first (one
output token, not streamed, with `do_remote_decode`), and the client's body goes to the decode replica with
the `kv_transfer_params` of that answer; the decode replica pulls the blocks and answers as any replica. Below
the threshold the decode replica computes the prompt itself, as llm-d's selective P/D does. A prefill step
that fails (no prefill replica with room, one that cannot be reached, does not answer within the prefill
timeout, answers 5xx or without params) costs the request nothing but time: it goes to the decode replica
without params. A prefill replica's 4xx is the client's error and is its answer. The decode call is retried
as any request is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import importlib.metadata
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from kvfleet.contract.errors import (
    INVALID_API_KEY_MESSAGE,
    MESSAGES_PATH,
    SLEEPING_CODE,
    AuthenticationError,
    BadRequestError,
    GatewayTimeoutError,
    NotFoundError,
    OpenAIError,
    OverloadedError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from kvfleet.contract.kv_transfer import DO_REMOTE_DECODE, PREFILL_MAX_TOKENS
from kvfleet.contract.request_ids import REQUEST_ID_HEADER, usable_request_id
from kvfleet.contract.resume import CONTINUATION, DRAINING_CODE
from kvfleet.gateway.adapters import DEFAULT_ADAPTER_POLL_SECONDS, poll_adapters
from kvfleet.gateway.discovery import Discovery, ModelConfig
from kvfleet.gateway.flow import DEFAULT_MAX_QUEUE, Fleet, ModelPool
from kvfleet.gateway.http_errors import error_response, openai_errors
from kvfleet.gateway.http_protocol import DEFAULT_CLIENT_TIMEOUTS, ClientTimeouts, TimedAppRunner
from kvfleet.gateway.keep_alive import HeldStream
from kvfleet.gateway.kv_events import EventEndpoints, KVEventFeeds
from kvfleet.gateway.kv_index import DEFAULT_MAX_ENTRIES, KVBlockIndex
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.model_tokenizers import ModelTokenizers
from kvfleet.gateway.prompt_blocks import ModelPrompts
from kvfleet.gateway.requests import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    RESPONSES_PATH,
    ROUTED_PATHS,
    STORED_RESPONSES_UNREACHABLE,
    RoutedRequest,
    parse_request,
)
from kvfleet.gateway.resumption import DEFAULT_MAX_RESUMES, Generation, Leg, LegUnavailable
from kvfleet.gateway.routing import BlockHashes, Prompt, Replica, estimated_tokens
from kvfleet.gateway.splice import MAX_EVENT_BYTES, EventReader, Splice, answered_error
from kvfleet.gateway.tracing import (
    GatewayTracing,
    answered,
    describe,
    failed,
    note,
    untraced,
    with_trace_context,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:
    from multidict import CIMultiDictProxy  # aiohttp's header type

logger = logging.getLogger(__name__)
# A replica's answers to GET /is_sleeping and POST /wake_up, and its error bodies, are small: no more is read.
_MAX_SMALL_ANSWER_BYTES = 4096

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Every request body the gateway holds at once, together: 16 bodies of the largest size.
DEFAULT_MAX_BUFFERED_BODY_BYTES = 16 * DEFAULT_MAX_BODY_BYTES
DEFAULT_MAX_ATTEMPTS = 3
# The request line and each header line at most, and how many headers; past them aiohttp answers 400/431.
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
# A body of known length up to this size is read whole and sent in one write; larger ones and SSE stream.
WHOLE_BODY_BYTES = 256 * 1024
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
FORWARDED_FOR = "X-Forwarded-For"
# Where a request keeps the id that names it (`_request_id`).
_REQUEST_ID = web.RequestKey("request_id", str)
# The request and response field of disaggregated prefill and decode (kvfleet.contract.kv_transfer).
KV_TRANSFER_PARAMS = "kv_transfer_params"
# A replica's error answer is a small JSON object; a longer one is cut to this.
MAX_ERROR_ANSWER_BYTES = 64 * 1024
# A prefill answer is one token and the prompt's block ids, about 8 bytes a block: those of a million-token
# prompt, at 16 tokens a block, take half a MiB.
MAX_PREFILL_ANSWER_BYTES = 4 * 1024 * 1024
# A prefill replica's answers of 4xx that are no fault of the client's: it could not read the body in time, or
# it is overloaded.
_NOT_THE_CLIENTS_FAULT = frozenset({408, 429})
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# The policies that route on a prompt's block hashes: the gateway tokenizes the prompts of their models.
BLOCK_HASH_POLICIES = frozenset({"precise-prefix"})
# Where a client's key may come: as a bearer token, or as Anthropic's clients send it.
API_KEY_HEADER = "x-api-key"
_KEY_HEADERS = frozenset({"authorization", API_KEY_HEADER})
# The requests that disaggregated prefill serves and that another replica resumes mid-stream.
GENERATION_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})
# The requests that are prompts to generate from, the Responses and Messages APIs' too: their streams are kept
# alive while held, and their prompts tokenized as the engine does for the policies that route on blocks; the
# others go to their replica as any request of a prefix-aware policy, routed on their text.
PROMPTED_PATHS = GENERATION_PATHS | {RESPONSES_PATH, MESSAGES_PATH}


@dataclass(frozen=True)
class UpstreamTimeouts:
    """Deadlines of a request to a replica, in seconds from when it is sent."""

    connect: float = 5.0
    # Until the response headers; a replica sends a non-streamed completion's headers when it is done.
    first_byte: float = 600.0
    # The longest silence between two chunks of the body (a stream's tokens, a body's bytes).
    idle: float = 120.0
    # The whole response, however it trickles.
    total: float = 3600.0
    # A prefill call of a disaggregated request, whole: past it the decode replica computes the prompt itself.
    # A prompt of many thousand tokens takes a GPU seconds; a replica that takes a minute has a problem, and
    # the client is better served by the decode replica than by waiting up to the first-byte timeout.
    prefill: float = 60.0
    # The longest silence between two chunks of a completion's or chat completion's stream: past it, the
    # stream is resumed on another replica. A replica sends a stream's headers with its first token.
    stall: float = 30.0


DEFAULT_UPSTREAM_TIMEOUTS = UpstreamTimeouts()


class BodyBudget:
    """The bytes of request bodies the gateway holds at once, across all requests: many uploads at once
    cannot take more memory than this."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, size: int) -> None:
        if self.held + size > self.max_bytes:
            raise OverloadedError(
                f"the gateway holds {self.max_bytes} bytes of request bodies at most, and they are in use",
                code="bodies_over_budget",
            )
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size


class Gateway:
    """The application and what its handlers share."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_resumes: int = DEFAULT_MAX_RESUMES,
        adapter_poll_seconds: float = DEFAULT_ADAPTER_POLL_SECONDS,
        max_buffered_body_bytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES,
        client_timeouts: ClientTimeouts = DEFAULT_CLIENT_TIMEOUTS,
        upstream_timeouts: UpstreamTimeouts = DEFAULT_UPSTREAM_TIMEOUTS,
        trusted_proxies: Sequence[Network] = (),
        bare_name_namespace: str | None = None,
        kv_events_endpoints: Mapping[str, EventEndpoints] | None = None,
        kv_index_max_entries: int = DEFAULT_MAX_ENTRIES,
        tokenizers: Mapping[str, ModelPrompts] | None = None,
        otlp_traces_endpoint: str | None = None,
        sse_keep_alive_interval: float = 0.0,
    ) -> None:
        """`trusted_proxies`: the peers whose X-Forwarded-For is kept (the peer's address is appended);
        `kv_events_endpoints`: where the replicas at these URLs publish their KV events, when not at their
        host's default ports (kvfleet.gateway.kv_events); `tokenizers`: the prompt preparation of models
        whose tokenizer is given locally, by model name; the others' is fetched from their replicas when their
        policy routes on block hashes; `otlp_traces_endpoint`: the OTLP collector the requests' spans go to
        (kvfleet.gateway.tracing); `sse_keep_alive_interval`: how long a streamed completion is held
        before its stream opens with keep-alive comments (kvfleet.gateway.keep_alive; 0: never)."""
        self.discovery = discovery
        self.adapter_poll_seconds = adapter_poll_seconds
        self.metrics = GatewayMetrics()
        kv_index = KVBlockIndex(kv_index_max_entries)
        self.fleet = Fleet(max_queue, self.metrics, bare_name_namespace, kv_index)
        self.kv_feeds = KVEventFeeds(kv_index, self.metrics.kv_index, kv_events_endpoints)
        self.max_attempts = max_attempts
        self.max_resumes = max_resumes
        self.max_body_bytes = max_body_bytes
        self.body_budget = BodyBudget(max_buffered_body_bytes)
        self.client_timeouts = client_timeouts
        self.upstream_timeouts = upstream_timeouts
        self.trusted_proxies = tuple(trusted_proxies)
        self.tokenizers = ModelTokenizers(tokenizers or {})
        self.session: aiohttp.ClientSession | None = None
        self.tracing = GatewayTracing(otlp_traces_endpoint) if otlp_traces_endpoint is not None else None
        self.sse_keep_alive_interval = sse_keep_alive_interval
        self._request_span = self.tracing.request_span if self.tracing is not None else untraced
        # The wake-up under way for each model with no ready replica (one at a time).
        self._waking: dict[str, asyncio.Task[None]] = {}
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[openai_errors])
        self.app.on_response_prepare.append(_named_by_request_id)
        for path in ROUTED_PATHS:
            self.app.router.add_post(path, self.inference)
        self.app.router.add_get(f"{RESPONSES_PATH}/{{response_id}}", self.stored_response)
        self.app.router.add_delete(f"{RESPONSES_PATH}/{{response_id}}", self.stored_response)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        # vLLM's name for the health check, and its version page, as a replica serves them.
        self.app.router.add_get("/ping", self.health)
        self.app.router.add_post("/ping", self.health)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_get("/metrics", self.prometheus)
        self.app.cleanup_ctx.append(self._lifetime)

    async def start(self, host: str, port: int) -> web.AppRunner:
        """Serves on host:port until the returned runner is cleaned up."""
        runner = TimedAppRunner(
            self.app,
            timeouts=self.client_timeouts,
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
            # The other deadlines are the gateway's own (_send, _body_chunks), which tell them apart.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.upstream_timeouts.connect),
        )
        watchers = [
            asyncio.create_task(self.discovery.run(self._published), name="kvfleet-gateway-discovery"),
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
            await self.kv_feeds.close()
            await self.tokenizers.close()
            await self.session.close()
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)

    def _published(self, models: Mapping[str, ModelConfig]) -> None:
        """Discovery's fleet: routed, and the KV events of its precise-prefix replicas followed."""
        self.fleet.update(models)
        self.kv_feeds.follow(self.fleet.replica_urls(policy="precise-prefix"))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": importlib.metadata.version("kvfleet")})

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

    async def inference(self, request: web.Request) -> web.StreamResponse:
        with self._request_span(request) as span:
            # Refused requests count under the model only once it is known to exist: no unbounded label
            # values.
            model_label = ""
            try:
                _authenticate_fleet(request.headers, (pool.config for pool in self.fleet.pools.values()))
                async with self._body(request) as body:
                    routed = parse_request(request.path, body, request.headers)
                    span.set_attribute("gen_ai.request.model", routed.model)
                    pool = self.fleet.resolve(routed.model)
                    if pool is None:
                        raise NotFoundError(
                            f"the model {routed.model!r} does not exist",
                            param="model",
                            code="model_not_found",
                        )
                    model_label = pool.config.name
                    _authenticate(request.headers, pool.config)
                    if self.sse_keep_alive_interval and routed.stream and request.path in PROMPTED_PATHS:
                        held = HeldStream(request, self.sse_keep_alive_interval)
                        response = await held.answer(self._forward(request, body, routed, pool, held))
                        status = held.status_of(response)
                    else:
                        response = await self._forward(request, body, routed, pool, None)
                        status = response.status
            except OpenAIError as error:
                response = error_response(error, request.path)
                status = response.status
            self.metrics.requests.labels(model_label, str(status)).inc()
            answered(span, response.status)
            return response

    async def stored_response(self, request: web.Request) -> web.Response:
        """GET and DELETE /v1/responses/{id}: refused with the reason (see kvfleet.gateway.requests), once
        the client has shown a key of the fleet."""
        try:
            _authenticate_fleet(request.headers, (pool.config for pool in self.fleet.pools.values()))
        except AuthenticationError as error:
            return error_response(error)
        return error_response(BadRequestError(STORED_RESPONSES_UNREACHABLE, param="response_id"))

    @contextlib.asynccontextmanager
    async def _body(self, request: web.Request) -> AsyncIterator[bytes]:
        """The request's body, read within the body timeout and held within the body budget until the
        request ends."""
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large()
        held = 0
        chunks: list[bytes] = []
        try:
            try:
                async with asyncio.timeout(self.client_timeouts.body_read):
                    async for chunk in request.content.iter_any():
                        self.body_budget.take(len(chunk))
                        held += len(chunk)
                        if held > self.max_body_bytes:
                            raise self._too_large()
                        chunks.append(chunk)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request body did not arrive within {self.client_timeouts.body_read:g} s",
                    code="body_timeout",
                    headers={"Connection": "close"},
                ) from None
            body = b"".join(chunks)
            chunks.clear()
            yield body
        finally:
            self.body_budget.give_back(held)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"the request body is larger than the gateway's limit of {self.max_body_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        routed: RoutedRequest,
        pool: ModelPool,
        held: HeldStream | None,
    ) -> web.StreamResponse:
        assert self.session is not None, "the session lives as long as the app"
        model, config = pool.config.name, pool.config
        priority = routed.priority if routed.priority is not None else config.default_priority
        describe(model=model, routing_policy=config.policy, priority=priority)
        headers, payload, body, resumable = self._replica_request(request, routed, config, body)
        # What each decode replica caches of the prompt before this request is routed there.
        prompt = _prompt(routed, config, await self._prompt_blocks(request.path, routed, pool))
        cached = pool.policy.cached_chars(pool.replicas, prompt) if pool.prefill is not None else {}
        arrived = time.monotonic()
        if from_zero := not pool.replicas:
            self._wake_a_sleeper(config, headers)
        tried: list[str] = []
        # Decided with the first decode replica: a retry sends the same body (the same prefill's params).
        decode_body: bytes | None = None
        failures = 0
        while failures < self.max_attempts:
            replica = await pool.acquire(priority, prompt, tried, routed.deadline_seconds)
            if not tried:
                self._waited(model, time.monotonic() - arrived)
            self._routed(config, replica, "decode")
            try:
                if decode_body is None:
                    prepared = await self._prefilled(
                        request.path,
                        body,
                        payload,
                        headers,
                        routed,
                        prompt,
                        pool,
                        priority,
                        cached.get(replica.url, 0),
                    )
                    if isinstance(prepared, web.Response):
                        pool.release(replica, priority)
                        return prepared
                    decode_body = prepared
                sent = time.monotonic()
                deadline = asyncio.get_running_loop().time() + self.upstream_timeouts.total
                upstream = await self._send(f"{replica.url}{request.path}", decode_body, headers, deadline)
            except aiohttp.ClientError as error:
                pool.release(replica, priority)
                self._retrying(model, replica, tried, "connection_error")
                failures += 1
                logger.info("%s: %s failed before answering (%s); retrying", model, replica.url, error)
                continue
            except BaseException:
                pool.release(replica, priority)  # the client left while the replica had not answered yet
                raise
            leg = Leg(replica, upstream, functools.partial(pool.release, replica, priority))
            try:
                self.metrics.upstream_latency.labels(model).observe(time.monotonic() - sent)
                if upstream.status == 503:
                    answer, refusal = await self._refused(upstream, replica, deadline)
                    if refusal != DRAINING_CODE and failures + 1 >= self.max_attempts:
                        return web.Response(status=503, body=answer, headers=_end_to_end(upstream.headers))
                    failures += self._passed_over(pool, replica, headers, tried, refusal)
                    continue
                if from_zero:
                    self.metrics.activation.labels(model).observe(time.monotonic() - arrived)
                if resumable and _is_event_stream(upstream):
                    generation = self._generation(request, routed, pool, payload, headers, prompt, deadline)
                    return await generation.relay(leg, _end_to_end(upstream.headers), tried, held)
                chunks = _body_chunks(upstream, self.upstream_timeouts.idle, deadline)
                return await _relay(request, upstream, chunks, model, held)
            finally:
                leg.close()
        raise ServiceUnavailableError(
            f"every replica of model {model!r} tried ({self.max_attempts} attempts) failed before answering",
            code="upstream_unavailable",
        )

    def _replica_request(
        self, request: web.Request, routed: RoutedRequest, config: ModelConfig, body: bytes
    ) -> tuple[list[tuple[str, str]], Mapping[str, Any], bytes, bool]:
        """What the replicas are sent (headers, payload and body), and whether they may resume it."""
        forwarded = _forward_headers(request.headers, request.remote, self.trusted_proxies)
        forwarded = [(name, value) for name, value in forwarded if name.lower() != REQUEST_ID_HEADER.lower()]
        forwarded.append((REQUEST_ID_HEADER, _request_id(request)))
        headers = _for_replicas_of(config, with_trace_context(forwarded))
        resumable = config.replicas_resume and _resumable(request.path, routed.payload)
        payload, body = _for_replicas(config, routed, body, resumable)
        if resumable:
            headers = _identity_encoded(headers)
        return headers, payload, body, resumable

    def _waited(self, model: str, seconds: float) -> None:
        """The request waited this long for a replica with room."""
        self.metrics.queue_wait.labels(model).observe(seconds)
        describe(queue_wait_s=seconds)

    def _routed(self, config: ModelConfig, replica: Replica, role: str) -> None:
        """The request is sent to this replica, as its `role`: decode (or the whole request), prefill, or a
        stream's continuation."""
        self.metrics.routing_decisions.labels(config.name, config.policy, replica.url).inc()
        note("replica", url=replica.url, role=role)

    def _retrying(self, model: str, replica: Replica, tried: list[str], reason: str) -> None:
        """The request goes to another replica than this one, for this reason."""
        tried.append(replica.url)
        self._counted_retry(model, replica, reason)

    def _counted_retry(self, model: str, replica: Replica, reason: str) -> None:
        self.metrics.retries.labels(model, reason).inc()
        note("retry", url=replica.url, reason=reason)

    async def _refused(
        self, upstream: aiohttp.ClientResponse, replica: Replica, deadline: float
    ) -> tuple[bytes, str | None]:
        """A replica's 503 answer (a small JSON object, read within the idle timeout; empty when it is longer
        than any error answer or does not arrive) and its error code; a draining replica is marked so."""
        loop = asyncio.get_running_loop()
        answer = b""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout_at(min(loop.time() + self.upstream_timeouts.idle, deadline)):
                answer = await _read_at_most(upstream, MAX_ERROR_ANSWER_BYTES)
        refusal = _error_code(answer)
        if refusal == DRAINING_CODE:
            replica.drains()
        return answer, refusal

    def _generation(
        self,
        request: web.Request,
        routed: RoutedRequest,
        pool: ModelPool,
        payload: Mapping[str, Any],
        headers: list[tuple[str, str]],
        prompt: Prompt,
        deadline: float,
    ) -> Generation:
        """The relay of a completion or chat completion, resumed on another replica where its stream fails;
        `payload` and `headers`: what its replicas are sent."""
        asked = routed.payload
        n = asked.get("n")
        splice = Splice(
            chat=request.path == CHAT_PATH,
            n=n if isinstance(n, int) and n > 0 else 1,
            token_ids_asked=asked.get("return_token_ids") is True,
        )
        priority = routed.priority if routed.priority is not None else pool.config.default_priority
        resume = functools.partial(
            self._resumed_leg, request.path, payload, headers, pool, prompt, priority, routed.deadline_seconds
        )
        return Generation(
            request,
            splice,
            functools.partial(resume, deadline),
            self.metrics,
            pool.config.name,
            streamed=routed.stream,
            max_resumes=self.max_resumes,
            stall=self.upstream_timeouts.stall,
            deadline=deadline,
        )

    def _passed_over(
        self,
        pool: ModelPool,
        replica: Replica,
        headers: list[tuple[str, str]],
        tried: list[str],
        refusal: str | None,
    ) -> int:
        """A replica answered 503 and the request is sent again: elsewhere, or to the same replica once woken
        where it said it sleeps (put to sleep since the kubelet last probed it). Counts as an attempt (1)
        unless the replica was draining: its refusal costs it no work, and each refuses a request once."""
        model = pool.config.name
        if refusal == SLEEPING_CODE:
            # An adapter's replicas are its base model's.
            self.fleet.fell_asleep(pool.config.adapter_of or model, replica.url)
            self._wake_a_sleeper(pool.config, headers)
            self._counted_retry(model, replica, "sleeping")
            return 1
        self._retrying(model, replica, tried, "draining" if refusal == DRAINING_CODE else "unavailable")
        return int(refusal != DRAINING_CODE)

    def _wake_a_sleeper(self, config: ModelConfig, headers: list[tuple[str, str]]) -> None:
        """The request waits for a replica of a service that keeps replicas asleep: one is woken meanwhile,
        so that the request does not wait for the operator to notice it."""
        if config.adapter_of is not None:
            config = self.fleet.models.get(config.adapter_of, config)
        if config.name in self._waking or not config.sleeping_endpoints:
            return
        task = asyncio.create_task(self._wake(config, headers), name=f"kvfleet-gateway-wake {config.name}")
        self._waking[config.name] = task
        task.add_done_callback(lambda _: self._waking.pop(config.name, None))

    async def _wake(self, config: ModelConfig, headers: list[tuple[str, str]]) -> None:
        """Wakes the first replica that says it sleeps (the others not ready are loading); with the request's
        key (Authorization or x-api-key), which is the service's key where the replicas are to get it."""
        session = self.session
        assert session is not None
        authorization = [(name, value) for name, value in headers if name.lower() in _KEY_HEADERS]
        timeout = aiohttp.ClientTimeout(total=config.hold_seconds)

        async def call(method: str, url: str) -> tuple[int, bytes]:
            async with session.request(method, url, headers=authorization, timeout=timeout) as answer:
                return answer.status, await answer.content.read(_MAX_SMALL_ANSWER_BYTES)

        async def sleeps(url: str) -> bool:
            status, body = await call("GET", f"{url}/is_sleeping")
            try:
                return status == 200 and json.loads(body)["is_sleeping"] is True
            except (ValueError, KeyError, TypeError):
                return False

        for url in config.sleeping_endpoints:
            try:
                if not await sleeps(url) or (await call("POST", f"{url}/wake_up"))[0] != 200:
                    continue
            except (aiohttp.ClientError, TimeoutError) as error:
                logger.warning("waking %s for %s failed: %s", url, config.name, error)
                continue
            logger.info("woke %s for %s", url, config.name)
            self.fleet.woke(config.name, url)
            return

    async def _resumed_leg(
        self,
        path: str,
        payload: Mapping[str, Any],
        headers: list[tuple[str, str]],
        pool: ModelPool,
        prompt: Prompt,
        priority: int,
        deadline_seconds: float | None,
        deadline: float,
        continuation: dict[str, Any] | None,
        tried: list[str],
    ) -> Leg:
        """A stream of the request from a replica not among `tried`, continuing from `continuation` (None: the
        request afresh); the blocks of a prefill replica are not asked for again. LegUnavailable when the
        replica cannot be reached or answers 5xx; its 4xx is raised as the client's answer."""
        replica = await pool.acquire(priority, prompt, tried, deadline_seconds)
        self._routed(pool.config, replica, "continuation")
        body = {name: value for name, value in payload.items() if name != KV_TRANSFER_PARAMS}
        if continuation is not None:
            body[CONTINUATION] = continuation
        try:
            upstream = await self._send(f"{replica.url}{path}", _json_body(body), headers, deadline)
        except (aiohttp.ClientError, GatewayTimeoutError) as error:
            pool.release(replica, priority)
            raise LegUnavailable(replica.url, str(error)) from None
        except BaseException:
            pool.release(replica, priority)
            raise
        leg = Leg(replica, upstream, functools.partial(pool.release, replica, priority))
        if upstream.status == 200 and _is_event_stream(upstream):
            return leg
        try:
            refusal = (
                (await self._refused(upstream, replica, deadline))[1] if upstream.status == 503 else None
            )
            if refusal == DRAINING_CODE:
                raise LegUnavailable(replica.url, "draining", draining=True)
            if upstream.status >= 500 or upstream.status == 200:
                raise LegUnavailable(replica.url, f"answered {upstream.status}")
            raise answered_error(upstream.status, await _read_at_most(upstream, MAX_ERROR_ANSWER_BYTES))
        finally:
            leg.close()

    async def _prompt_blocks(self, path: str, routed: RoutedRequest, pool: ModelPool) -> BlockHashes | None:
        """The prompt's block hashes, for a policy that routes on them, once the model's tokenizer is at hand;
        tokenized on a thread, so that a long prompt does not hold the event loop."""
        config = pool.config
        if config.policy not in BLOCK_HASH_POLICIES or path not in PROMPTED_PATHS:
            return None
        assert self.session is not None, "the session lives as long as the app"
        model = config.adapter_of or config.name
        prompts = self.tokenizers.get(model, config.endpoints, self.session)
        if prompts is None:
            return None
        if config.adapter_of is None:
            lora_int_ids = {0}
        else:
            served = (replica.lora_int_ids.get(config.upstream_name) for replica in pool.replicas)
            lora_int_ids = {lora_int_id for lora_int_id in served if lora_int_id is not None}
        try:
            return await asyncio.to_thread(prompts.blocks, path, routed.payload, lora_int_ids)
        except Exception:  # routing goes on without hashes; a request never fails for them
            logger.exception("%s: the prompt's block hashes could not be computed", config.name)
            return None

    async def _prefilled(
        self,
        path: str,
        body: bytes,
        payload: Mapping[str, Any],
        headers: list[tuple[str, str]],
        routed: RoutedRequest,
        prompt: Prompt,
        pool: ModelPool,
        priority: int,
        cached_chars: int,
    ) -> bytes | web.Response:
        """The body for the decode replica, which is taken to cache `cached_chars` of the prompt: `payload`
        (whose body is `body`) with the kv_transfer_params of a prefill replica's answer when the model has
        prefill replicas and the prompt's new tokens reach its threshold; `body` otherwise, or when the
        prefill step fails. A prefill replica's 4xx answer is returned instead, as the request's answer."""
        prefill = pool.prefill
        if prefill is None:
            return body
        model = pool.config.name
        new_tokens = estimated_tokens(max(0, len(routed.prompt_text) - cached_chars))
        if new_tokens < pool.config.pd_threshold_tokens or not _transfers_kv(path, routed.payload):
            self.metrics.pd.requests.labels(model, "decode_only").inc()
            return body
        try:
            answer = await self._prefill(path, headers, routed, prompt, prefill, priority)
        except _PrefillFailed as failure:
            self.metrics.pd.prefill_fallbacks.labels(model, failure.reason).inc()
            note("prefill_failed", reason=failure.reason)
            self.metrics.pd.requests.labels(model, "decode_only").inc()
            logger.info(
                "%s: prefill step failed (%s); the decode replica computes the prompt", model, failure
            )
            return body
        if isinstance(answer, web.Response):
            return answer
        self.metrics.pd.requests.labels(model, "disaggregated").inc()
        return _json_body({**payload, KV_TRANSFER_PARAMS: answer})

    async def _prefill(
        self,
        path: str,
        headers: list[tuple[str, str]],
        routed: RoutedRequest,
        prompt: Prompt,
        prefill: ModelPool,
        priority: int,
    ) -> dict[str, Any] | web.Response:
        """A prefill replica's kv_transfer_params for the request, or its 4xx answer; _PrefillFailed when no
        prefill replica has room or the one chosen fails. Its place is given back once it has answered."""
        assert self.session is not None, "the session lives as long as the app"
        config = prefill.config
        replica = prefill.try_acquire(priority, prompt)
        if replica is None:
            raise _PrefillFailed("busy", "no prefill replica has room")
        self._routed(config, replica, "prefill")
        # Never longer than the decode replica would be given to answer.
        limit = min(self.upstream_timeouts.prefill, self.upstream_timeouts.first_byte)
        started = time.monotonic()
        try:
            async with (
                asyncio.timeout(limit),
                self.session.post(
                    f"{replica.url}{path}",
                    data=_prefill_body(config, routed),
                    headers=_identity_encoded(headers),
                ) as answer,
            ):
                content = await _read_at_most(answer, MAX_PREFILL_ANSWER_BYTES)
                status, answer_headers = answer.status, answer.headers
        except aiohttp.ClientError as error:  # a connect timeout included
            raise _PrefillFailed("unreachable", f"{replica.url}: {error}") from None
        except TimeoutError:
            raise _PrefillFailed("timeout", f"{replica.url} did not answer within {limit:g} s") from None
        finally:
            prefill.release(replica, priority)
            self.metrics.pd.prefill_duration.labels(config.name).observe(time.monotonic() - started)
        if status == 503 and _error_code(content) == DRAINING_CODE:
            replica.drains()
        return _prefill_answer(replica.url, status, answer_headers, content)

    async def _send(
        self, url: str, body: bytes, headers: list[tuple[str, str]], deadline: float
    ) -> aiohttp.ClientResponse:
        """The replica's response headers. A replica that cannot be reached raises aiohttp.ClientError (its
        connect timeout included), and the request may go to another; one that accepted the request but does
        not answer within the first-byte timeout is a 504: it may still be working on it, so it is not sent
        again elsewhere."""
        assert self.session is not None, "the session lives as long as the app"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(min(loop.time() + self.upstream_timeouts.first_byte, deadline)):
                return await self.session.post(url, data=body, headers=headers)
        except TimeoutError as error:
            if isinstance(error, aiohttp.ClientError):
                raise
            raise GatewayTimeoutError(
                f"the replica did not answer within {self.upstream_timeouts.first_byte:g} s",
                code="upstream_timeout",
            ) from None


class _PrefillFailed(Exception):
    """The prefill step gave no kv_transfer_params; `reason` is the metric's label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _resumable(path: str, payload: Mapping[str, Any]) -> bool:
    """Whether a request is relayed as a Generation, resumed elsewhere when its replica fails: a completion
    or chat completion, unless it is the client's own step of disaggregated prefill and decode (whose answer
    carries kv_transfer_params, which only a replica's non-streamed answer has) or a continuation the client
    sends itself (which it resumes itself)."""
    return (
        path in GENERATION_PATHS and payload.get(KV_TRANSFER_PARAMS) is None and CONTINUATION not in payload
    )


def _streamed_with_token_ids(payload: Mapping[str, Any], streamed: bool) -> dict[str, Any]:
    """The body that asks a replica for the stream a request is resumed from: streamed, with each chunk's
    token ids; with the usage when the client asked for it, and always for a non-streamed answer (which
    has it)."""
    if not streamed and payload.get("stream_options") is not None:
        raise BadRequestError("stream_options is only allowed when stream is true", param="stream_options")
    upstream = {**payload, "stream": True, "return_token_ids": True}
    if not streamed:
        upstream["stream_options"] = {"include_usage": True}
    return upstream


def _for_replicas(
    config: ModelConfig, routed: RoutedRequest, body: bytes, resumable: bool
) -> tuple[dict[str, Any], bytes]:
    """The body the replicas are sent, parsed and as bytes: with `model` as they know it, and for a request
    that may be resumed, asking for the stream it is resumed from."""
    payload = {**routed.payload, "model": config.upstream_name}
    if resumable:
        payload = _streamed_with_token_ids(payload, routed.stream)
        return payload, _json_body(payload)
    return payload, _renamed_for_replicas(config, routed, body)


def _error_code(answer: bytes) -> str | None:
    """The `code` of a replica's error answer, if it is one."""
    try:
        code = json.loads(answer)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def _is_event_stream(upstream: aiohttp.ClientResponse) -> bool:
    return upstream.content_type == "text/event-stream"


def _transfers_kv(path: str, payload: Mapping[str, Any]) -> bool:
    """Whether a request can take its prompt's KV from a prefill replica: a completion or a chat completion
    (the protocol's requests) of one choice of one prompt given as text or tokens, as the protocol hands over
    the blocks of one sequence (the engines refuse n > 1 with kv_transfer_params)."""
    if path not in GENERATION_PATHS or payload.get("prompt_embeds") is not None:
        return False
    prompt = payload.get("prompt")
    batched = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
    return payload.get("n") in (None, 1) and not batched


def _prefill_body(config: ModelConfig, routed: RoutedRequest) -> bytes:
    """The prefill call: the client's body computing one token, not streamed, that keeps its blocks for a
    decode replica. Its min_tokens goes: past the one token, the engine would refuse it."""
    payload = {
        **routed.payload,
        "model": config.upstream_name,
        KV_TRANSFER_PARAMS: {DO_REMOTE_DECODE: True},
        "max_tokens": PREFILL_MAX_TOKENS,
        "stream": False,
    }
    if "max_completion_tokens" in payload:
        payload["max_completion_tokens"] = PREFILL_MAX_TOKENS
    for name in ("stream_options", "min_tokens"):
        payload.pop(name, None)
    return _json_body(payload)


def _prefill_answer(
    url: str, status: int, headers: CIMultiDictProxy[str], content: bytes
) -> dict[str, Any] | web.Response:
    """The kv_transfer_params of a prefill replica's answer, or the answer itself when it is the client's
    error; _PrefillFailed otherwise."""
    if 400 <= status < 500 and status not in _NOT_THE_CLIENTS_FAULT:
        return web.Response(status=status, body=content, headers=_end_to_end(headers))
    if not 200 <= status < 300:
        raise _PrefillFailed("error_status", f"{url} answered {status}")
    try:
        params = json.loads(content).get(KV_TRANSFER_PARAMS)
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict) or not params:
        raise _PrefillFailed("no_params", f"{url} answered without {KV_TRANSFER_PARAMS}")
    return params


async def _read_at_most(answer: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's body; an empty one past `limit` bytes (which no answer with params is)."""
    chunks: list[bytes] = []
    read = 0
    while chunk := await answer.content.readany():
        read += len(chunk)
        if read > limit:
            return b""
        chunks.append(chunk)
    return b"".join(chunks)


def _identity_encoded(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers asking for a body the gateway can read (its session passes bodies through undecoded)."""
    kept = [(name, value) for name, value in headers if name.lower() != "accept-encoding"]
    return [*kept, ("Accept-Encoding", "identity")]


async def _body_chunks(
    upstream: aiohttp.ClientResponse, idle: float, deadline: float
) -> AsyncIterator[bytes]:
    """The replica's body as it arrives. TimeoutError once the replica has been silent for `idle` seconds, or
    at `deadline` (loop time): one that trickles holds the request no longer than the whole-response
    deadline."""
    loop = asyncio.get_running_loop()
    while True:
        async with asyncio.timeout_at(min(loop.time() + idle, deadline)):
            chunk = await upstream.content.readany()
        if not chunk:
            return
        yield chunk


async def _relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    chunks: AsyncIterator[bytes],
    model: str,
    held: HeldStream | None,
) -> web.StreamResponse:
    """The replica's response (its body as `chunks` yields it), streamed to the client as it arrives (into
    the stream `held` opened, if it did); a small whole body (a non-streamed completion, which a replica
    sends only once it is done) goes out in one piece."""
    headers = _end_to_end(upstream.headers)
    event_stream = upstream.content_type == "text/event-stream"
    length = upstream.content_length
    if not event_stream and length is not None and length <= WHOLE_BODY_BYTES:
        try:
            body = b"".join([chunk async for chunk in chunks])
        except aiohttp.ClientError as error:
            raise ServiceUnavailableError(
                f"the replica serving model {model!r} failed mid-response: {error}",
                code="upstream_failed",
            ) from None
        except TimeoutError:
            raise GatewayTimeoutError(
                f"the replica serving model {model!r} stopped sending its response", code="upstream_timeout"
            ) from None
        return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)
    response = held.claim() if held is not None else None
    if response is None:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        if length is not None:
            response.content_length = length
        await response.prepare(request)
    # An event stream goes out whole events at a time: a replica that breaks off within one leaves the client
    # no half of it before the failure's event. A Responses stream's failure is numbered after those relayed.
    unfinished = bytearray()
    responses = EventReader() if event_stream and request.path == RESPONSES_PATH else None
    relayed = 0
    try:
        async for chunk in chunks:
            if not event_stream:
                await response.write(chunk)
                continue
            unfinished += chunk
            end = unfinished.rfind(b"\n\n") + 2
            if end < 2 and len(unfinished) <= MAX_EVENT_BYTES:
                continue
            complete = bytes(unfinished[:end] if end >= 2 else unfinished)
            del unfinished[: len(complete)]
            await response.write(complete)
            if responses is not None:
                relayed += len(responses.feed(complete))
        await response.write(bytes(unfinished))
    except (aiohttp.ClientError, TimeoutError) as error:
        timed_out = not isinstance(error, aiohttp.ClientError)
        logger.warning(
            "%s: the replica broke off its response (%s)", model, "stalled" if timed_out else error
        )
        failed(f"the replica broke off its response ({'stalled' if timed_out else error})")
        if not event_stream:
            # A plain body cut short must not look complete: drop the connection instead of ending it.
            if request.transport is not None:
                request.transport.close()
            return response
        failure: OpenAIError = (
            GatewayTimeoutError(
                f"the replica serving model {model!r} stopped sending its stream", code="upstream_timeout"
            )
            if timed_out
            else ServiceUnavailableError(
                f"the replica serving model {model!r} failed mid-stream", code="upstream_failed"
            )
        )
        if responses is not None:
            framed = failure.to_response_event(relayed)
        else:
            framed = failure.to_messages_event() if request.path == MESSAGES_PATH else failure.to_sse()
        await response.write(framed.encode())
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


def _authenticate_fleet(headers: Mapping[str, str], configs: Iterable[ModelConfig]) -> None:
    """Before the body is read (and so before the model it names is known): a client must present the key
    of some service of the fleet, unless a model needs none. A client without one is refused at once, never
    making the gateway hold its body; its model's own key is checked once the body names the model. While
    some service's Secret cannot be read, any key may be its key: the check is left to that model's (503)."""
    digests: set[bytes] = set()
    for config in configs:
        if config.client_key is None or config.client_key.sha256 is None:
            return
        digests.add(config.client_key.sha256)
    if not digests:
        return
    # A set lookup of a SHA-256 digest: its timing tells nothing about the key.
    if _presented_digest(headers) not in digests:
        raise AuthenticationError(
            INVALID_API_KEY_MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )


def _presented_digest(headers: Mapping[str, str]) -> bytes | None:
    """The SHA-256 digest of the request's key: its bearer token, else its x-api-key (as Anthropic's clients
    send it); None without either."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = headers.get(API_KEY_HEADER, "")
        if not token:
            return None
    return hashlib.sha256(token.strip().encode()).digest()


def _presents(headers: Mapping[str, str], key_sha256: bytes) -> bool:
    """Whether the request carries the key as a bearer token."""
    presented = _presented_digest(headers)
    return presented is not None and hmac.compare_digest(presented, key_sha256)


def _may_use(headers: Mapping[str, str], config: ModelConfig) -> bool:
    """Whether a request with these headers may use the model, for /v1/models: a model needing no key, or
    one whose key the request carries. A model whose key cannot be read is shown to no one."""
    key = config.client_key
    return key is None or (key.sha256 is not None and _presents(headers, key.sha256))


def _for_replicas_of(config: ModelConfig, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers without the client's key (Authorization or x-api-key) where the model's replicas are not
    to get it: a key reaches only the service it was checked for (`_authenticate` ran before)."""
    if config.forward_authorization:
        return headers
    return [(name, value) for name, value in headers if name.lower() not in _KEY_HEADERS]


def _prompt(routed: RoutedRequest, config: ModelConfig, block_hashes: BlockHashes | None) -> Prompt:
    """What routing knows of the request's prompt; an adapter's requests name it as its replicas serve it."""
    adapter = config.upstream_name if config.adapter_of is not None else None
    return Prompt(routed.prompt_text, adapter, block_hashes)


def _renamed_for_replicas(config: ModelConfig, routed: RoutedRequest, body: bytes) -> bytes:
    """The body with `model` as the replicas know it (`team-prod/llama-8b` is `llama-8b` there)."""
    if routed.model == config.upstream_name:
        return body
    return _json_body({**routed.payload, "model": config.upstream_name})


def _json_body(payload: Mapping[str, Any]) -> bytes:
    """Compact and in UTF-8, so a body rewritten for the replicas does not outgrow what the client sent by
    more than what was changed."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def _end_to_end(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The headers that describe the message, not the hop: neither the hop-by-hop ones nor those that the
    message's `Connection` header names (RFC 9110 section 7.6.1)."""
    named = {
        token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")
    }
    return [
        (name, value)
        for name, value in headers.items()
        if name.lower() not in _HOP_BY_HOP and name.lower() not in named
    ]


def _request_id(request: web.Request) -> str:
    """The id that names the request: the client's X-Request-Id where it can be one, or one made for it the
    first time it is asked for."""
    if _REQUEST_ID not in request:
        request[_REQUEST_ID] = usable_request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex
    return request[_REQUEST_ID]


async def _named_by_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REQUEST_ID_HEADER] = _request_id(request)


def _forward_headers(
    headers: CIMultiDictProxy[str], peer: str | None, trusted_proxies: Sequence[Network]
) -> list[tuple[str, str]]:
    """The client's end-to-end headers, with X-Forwarded-For set from the peer's address: a client's own
    X-Forwarded-For is kept (and the peer appended) only when the peer is a trusted proxy."""
    forwarded = [(name, value) for name, value in _end_to_end(headers) if name.lower() != "x-forwarded-for"]
    chain = headers.getall(FORWARDED_FOR, []) if _is_trusted(peer, trusted_proxies) else []
    if peer is not None:
        chain.append(peer)
    if chain:
        forwarded.append((FORWARDED_FOR, ", ".join(chain)))
    return forwarded


def _is_trusted(peer: str | None, trusted_proxies: Sequence[Network]) -> bool:
    if peer is None or not trusted_proxies:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in network for network in trusted_proxies)
