"""The FastAPI application: routes, error handlers, middleware, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from kvfleet.runtime.metrics import CONTENT_TYPE
from kvfleet.runtime.server.auth import ApiKeyAuth
from kvfleet.runtime.server.errors import (
    BadRequestError,
    ClientDisconnectedError,
    ServiceUnavailableError,
    install_error_handlers,
)
from kvfleet.runtime.server.middleware import BodyReadTimeout, BodySizeLimit, InFlightCounter
from kvfleet.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvfleet.runtime.server.serving_chat import OpenAIServingChat
from kvfleet.runtime.server.serving_completions import OpenAIServingCompletion
from kvfleet.runtime.server.state import ServerState
from starlette.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

# What a client that has gone away is "answered" with; nobody reads it (nginx's convention).
_CLIENT_CLOSED_REQUEST = 499


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="kvfleet",
        summary="An OpenAI-compatible inference server",
        lifespan=_lifespan(state),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.server = state
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnectedError, _client_gone)
    # Outermost last: auth first, then the body's time and size limits, then in-flight counting for drains.
    app.add_middleware(InFlightCounter, state=state)
    app.add_middleware(BodySizeLimit, max_bytes=state.settings.max_request_body_bytes)
    app.add_middleware(BodyReadTimeout, timeout=state.settings.body_read_timeout)
    if state.settings.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=state.settings.api_key)
    _add_routes(app, state)
    return app


def _lifespan(state: ServerState) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        loader = asyncio.create_task(_finish_loading(state))
        try:
            yield
        finally:
            loader.cancel()
            await state.engine.shutdown()

    return lifespan


def _load_tokenizer(path: str, chat_template: str | None) -> Any:
    # Imported here, on a worker thread: importing transformers takes seconds the event loop cannot spare.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = chat_template
    return tokenizer


async def _finish_loading(state: ServerState) -> None:
    config = state.engine.config
    try:
        # After the engine, never alongside it: transformers' lazy imports are not thread-safe.
        await state.engine.wait_loaded()
        state.load_error = state.engine.error
        if state.load_error is None:
            # The template the engine settled on (--chat-template, else the model folder's).
            template = state.engine.engine.tokenizer.chat_template
            state.tokenizer = await asyncio.to_thread(
                _load_tokenizer, config.tokenizer or config.model, template
            )
    except Exception as exc:
        logger.exception("loading the tokenizer failed")
        state.load_error = exc
    finally:
        state.loaded.set()
    if state.load_error is None:
        logger.info("ready: serving %r", state.settings.served_model_name)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=_CLIENT_CLOSED_REQUEST)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if state.load_error is not None or not state.engine.alive:
            return JSONResponse({"status": "failed"}, status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": state.not_ready_reason()}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        engine = state.engine.engine
        card = {
            "id": state.settings.served_model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvfleet",
            # vLLM's fields; never the model's path on disk, which clients have no business knowing.
            "root": state.settings.served_model_name,
            "parent": None,
            "max_model_len": engine.max_model_len if engine is not None else None,
            # kvfleet's addition: what `kvfleet bench serve` draws random token-id prompts from.
            "vocab_size": engine.vocab_size if engine is not None else None,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(body, raw_request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        body.check()
        _require_loaded(state)
        completions.check_model(body.model)
        if body.messages is not None:
            token_ids = completions.chat_prompt(body.messages, body.add_generation_prompt)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = state.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        max_model_len = state.engine.engine.max_model_len
        return JSONResponse({"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        _require_loaded(state)
        completions.check_model(body.model)
        vocab_size = state.engine.engine.vocab_size
        bad = [token for token in body.tokens if not 0 <= token < vocab_size]
        if bad:
            raise BadRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})


def _require_loaded(state: ServerState) -> None:
    if state.tokenizer is None or not state.engine.ready:
        raise ServiceUnavailableError(state.not_ready_reason(), code="unavailable")
