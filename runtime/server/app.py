"""The FastAPI application: routes, error handlers, middleware, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from kvfleet.contract.errors import COUNT_TOKENS_PATH, MESSAGES_PATH
from kvfleet.contract.request_ids import REQUEST_ID_HEADER
from kvfleet.contract.tiers import PRIORITY_HEADER
from kvfleet.contract.tokenizer_files import TOKENIZER_FILES_PATH
from kvfleet.runtime.batch.store import BatchStore
from kvfleet.runtime.chat_prompt import read_chat_template, sample_token_ids
from kvfleet.runtime.metrics import CONTENT_TYPE
from kvfleet.runtime.server.auth import ApiKeyAuth
from kvfleet.runtime.server.batch_routes import FILES_PATH, BatchService, add_batch_routes
from kvfleet.runtime.server.errors import (
    ClientDisconnectedError,
    install_error_handlers,
)
from kvfleet.runtime.server.json_bodies import DepthCheckedRoute
from kvfleet.runtime.server.middleware import (
    BodyReadTimeout,
    BodySizeLimit,
    HeaderCountLimit,
    InFlightCounter,
    RequestIdHeader,
    TraceContext,
)
from kvfleet.runtime.server.state import ServerState
from kvfleet.runtime.server.streaming import (
    respond,
    stream_response,
    typed_sse_events,
    unless_disconnected,
)
from kvfleet.runtime.server.tokenizer_files import tokenizer_files
from kvfleet.runtime.server.tokenizer_info import tokenizer_info
from kvfleet.runtime.serving.embedding_encoding import EmbeddingBytes
from kvfleet.runtime.serving.embeddings import OpenAIServingEmbedding
from kvfleet.runtime.serving.lora import OpenAIServingLoRA
from kvfleet.runtime.serving.messages_api import AnthropicServingMessages
from kvfleet.runtime.serving.messages_protocol import CountTokensRequest, MessagesRequest
from kvfleet.runtime.serving.moderations import OpenAIServingModeration
from kvfleet.runtime.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModerationRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvfleet.runtime.serving.request import RequestHeaders
from kvfleet.runtime.serving.response_store import ResponseStore
from kvfleet.runtime.serving.responses_api import OpenAIServingResponses
from kvfleet.runtime.serving.responses_protocol import ResponsesRequest
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response

logger = logging.getLogger(__name__)

# What a client that has gone away is "answered" with; nobody reads it (nginx's convention).
_CLIENT_CLOSED_REQUEST = 499
_MULTIPART_FRAMING_BYTES = 64 << 10


def build_app(state: ServerState) -> FastAPI:
    batches = _batch_service(state)
    app = FastAPI(
        title="kvfleet",
        summary="An OpenAI-compatible inference server",
        lifespan=_lifespan(state, batches),
        docs_url=None,
        redoc_url=None,
        openapi_url=None if state.settings.disable_fastapi_docs else "/openapi.json",
        root_path=state.settings.root_path,
    )
    app.state.server = state
    app.router.route_class = DepthCheckedRoute
    install_error_handlers(app, state.settings.log_error_stack)
    app.add_exception_handler(ClientDisconnectedError, _client_gone)
    # Outermost last: auth first, then the body's time and size limits, then in-flight counting for drains.
    app.add_middleware(InFlightCounter, state=state)
    upload_limits = {}
    if batches is not None:
        # Room for the multipart framing around the file; the file itself is held to its limit exactly.
        upload_limits[FILES_PATH] = state.settings.max_batch_file_bytes + _MULTIPART_FRAMING_BYTES
    app.add_middleware(
        BodySizeLimit, max_bytes=state.settings.max_request_body_bytes, path_limits=upload_limits
    )
    app.add_middleware(BodyReadTimeout, timeout=state.settings.body_read_timeout)
    if state.settings.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=state.settings.api_key)
    if state.settings.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    if state.settings.otlp_traces_endpoint is not None:
        app.add_middleware(TraceContext)
    app.add_middleware(HeaderCountLimit, max_headers=state.settings.h11_max_header_count)
    # Outside auth: a browser's preflight carries no key, and a 401 needs CORS headers for the page to see it.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=state.settings.allowed_origins,
        allow_methods=state.settings.allowed_methods,
        allow_headers=state.settings.allowed_headers,
        allow_credentials=state.settings.allow_credentials,
    )
    _add_probe_routes(app, state)
    _add_routes(app, state)
    _add_responses_routes(app, state)
    _add_messages_routes(app, state)
    _add_embedding_routes(app, state)
    if state.engine.config.enable_sleep_mode:
        _add_sleep_routes(app, state)
    if batches is not None:
        add_batch_routes(app, batches)
    return app


def _batch_service(state: ServerState) -> BatchService | None:
    settings = state.settings
    if settings.batch_store is None:
        return None
    store = BatchStore(
        Path(settings.batch_store),
        max_file_bytes=settings.max_batch_file_bytes,
        max_files=settings.max_batch_files,
        max_store_bytes=settings.max_batch_store_bytes,
    )
    return BatchService(state, store)


def _lifespan(state: ServerState, batches: BatchService | None) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The port opens at once: /health answers while the model loads, and requests wait for it.
        loader = asyncio.create_task(state.engine.start())
        try:
            if batches is None:
                yield
            else:
                # Stopped before the engine: lines in flight then are run again by the next start.
                async with batches.running():
                    yield
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            await state.engine.shutdown()
            if state.guardrails is not None:
                await state.guardrails.aclose()

    return lifespan


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=_CLIENT_CLOSED_REQUEST)


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """What probes and scrapes read (PROBE_PATHS): liveness, readiness, the version, metrics and load."""

    @app.get("/health")
    async def health() -> Response:
        if state.failure is not None:
            return JSONResponse({"status": "failed", "reason": state.failure}, status_code=503)
        return JSONResponse({"status": "alive"})

    # vLLM's (SageMaker's) name for the health check; a route per method gives each its OpenAPI operation id.
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method])

    @app.get("/version")
    async def server_version() -> Response:
        return JSONResponse({"version": version("kvfleet")})

    @app.get("/ready")
    async def ready() -> Response:
        if state.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": state.not_ready_reason()}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    if state.settings.enable_server_load_tracking:

        @app.get("/load")
        async def load() -> Response:
            return JSONResponse({"server_load": state.in_flight})


def _add_routes(app: FastAPI, state: ServerState) -> None:
    service = state.openai_service()
    lora = OpenAIServingLoRA(service)
    moderations = OpenAIServingModeration(service)
    started = int(time.time())

    read_tokenizer_files = functools.cache(lambda: tokenizer_files(service.engine.config))

    @app.get(TOKENIZER_FILES_PATH)
    async def tokenizer() -> Response:
        try:
            files = await asyncio.to_thread(read_tokenizer_files)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "server_error"}}, status_code=503)
        samples = await service.engine.run_tokenizer(sample_token_ids)
        rendering = service.settings.chat_rendering.as_json()
        return JSONResponse({**files, "samples": samples, "chat_rendering": rendering})

    if state.settings.enable_tokenizer_info_endpoint:
        config = service.engine.config
        chat_template = None if config.chat_template is None else read_chat_template(config.chat_template)

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> Response:
            return JSONResponse(
                await service.engine.run_tokenizer(lambda t: tokenizer_info(t, chat_template))
            )

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [*service.model_cards(started), *lora.model_cards(started)]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await lora.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await lora.unload(body))

    # vLLM's: the replica's cache starts cold again, as for the next run of a benchmark.
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        service.engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        request = await service.create_completion(body, _headers(raw_request))
        return await respond(raw_request, service, request, state.settings.sse_keep_alive_interval)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        request = await service.create_chat_completion(body, _headers(raw_request))
        return await respond(raw_request, service, request, state.settings.sse_keep_alive_interval)

    @app.post("/v1/moderations")
    async def create_moderation(body: ModerationRequest) -> Response:
        return JSONResponse(await moderations.create_moderation(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return JSONResponse(await service.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return JSONResponse(await service.detokenize(body))


def _add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's sleep mode, served only with --enable-sleep-mode (404 without, as vLLM's). Requests that arrive
    while the engine sleeps are answered 503 `sleeping` with Retry-After; /ready answers 503 meanwhile."""
    engine = state.engine

    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> Response:
        await engine.sleep(level, mode)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        await engine.wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": engine.is_sleeping})


def _add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/responses; with a store, GET and DELETE /v1/responses/{id} too."""
    max_stored = state.settings.max_stored_responses
    responses = OpenAIServingResponses(
        state.openai_service(), ResponseStore(max_stored) if max_stored else None
    )

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        prepared = await responses.create(body, _headers(raw_request))
        if body.stream:
            return await stream_response(
                raw_request,
                responses.stream(prepared),
                lambda chunks: typed_sse_events(responses.events(prepared, chunks)),
                state.settings.sse_keep_alive_interval,
            )
        return JSONResponse(await unless_disconnected(raw_request, responses.complete(prepared)))

    if responses.store is not None:

        @app.get("/v1/responses/{response_id}")
        async def retrieve_response(response_id: str) -> Response:
            return JSONResponse(responses.retrieve(response_id))

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str) -> Response:
            return JSONResponse(responses.delete(response_id))


def _add_messages_routes(app: FastAPI, state: ServerState) -> None:
    """Anthropic's Messages API, as vLLM serves it: POST /v1/messages and /v1/messages/count_tokens."""
    messages = AnthropicServingMessages(state.openai_service())

    @app.post(MESSAGES_PATH)
    async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
        prepared = await messages.create(body, _headers(raw_request))
        if body.stream:
            return await stream_response(
                raw_request,
                messages.stream(prepared),
                lambda chunks: typed_sse_events(messages.events(prepared, chunks)),
                state.settings.sse_keep_alive_interval,
            )
        return JSONResponse(await unless_disconnected(raw_request, messages.complete(prepared)))

    @app.post(COUNT_TOKENS_PATH)
    async def count_message_tokens(body: CountTokensRequest) -> Response:
        return JSONResponse(await messages.count_tokens(body))


def _add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/embeddings, and vLLM's pooling, score and rerank routes on the same embeddings."""
    embeddings = OpenAIServingEmbedding(state.openai_service())

    async def embedded(
        raw_request: Request, creating: Awaitable[dict[str, Any] | EmbeddingBytes]
    ) -> Response:
        answer = await unless_disconnected(raw_request, creating)
        if isinstance(answer, EmbeddingBytes):
            headers = {"metadata": json.dumps(answer.metadata)} if answer.metadata is not None else None
            return Response(answer.content, media_type="application/octet-stream", headers=headers)
        return JSONResponse(answer)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await embedded(raw_request, embeddings.create_embedding(body, _headers(raw_request)))

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw_request: Request) -> Response:
        return await embedded(raw_request, embeddings.create_pooling(body, _headers(raw_request)))

    async def create_score(body: ScoreRequest, raw_request: Request) -> Response:
        answer = embeddings.create_score(body, _headers(raw_request))
        return JSONResponse(await unless_disconnected(raw_request, answer))

    async def rerank(body: RerankRequest, raw_request: Request) -> Response:
        answer = embeddings.rerank(body, _headers(raw_request))
        return JSONResponse(await unless_disconnected(raw_request, answer))

    # vLLM's other paths for them are served too, and documented once.
    app.add_api_route("/v1/score", create_score, methods=["POST"])
    app.add_api_route("/score", create_score, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/rerank", rerank, methods=["POST"])
    for path in ("/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], include_in_schema=False)


def _headers(raw_request: Request) -> RequestHeaders:
    return RequestHeaders(
        raw_request.headers.get(PRIORITY_HEADER), raw_request.headers.get(REQUEST_ID_HEADER)
    )
