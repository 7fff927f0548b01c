"""Runs one batch line through the same handler, checks and response building as its HTTP route, at the
`batch` tier, without an HTTP request: the offline runner and the Batch API both answer lines this way."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

from kvfleet.contract.tiers import BACKGROUND_TIER, TIERS
from kvfleet.runtime.batch.lines import CHAT_COMPLETIONS_URL, COMPLETIONS_URL
from kvfleet.runtime.engine.errors import EngineError
from kvfleet.runtime.server.errors import (
    BadRequestError,
    InternalServerError,
    OpenAIError,
    from_engine_error,
    validation_error,
)
from kvfleet.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.runtime.server.serving_chat import OpenAIServingChat
from kvfleet.runtime.server.serving_completions import OpenAIServingCompletion
from kvfleet.runtime.server.state import ServerState
from pydantic import ValidationError
from starlette.requests import Request

logger = logging.getLogger(__name__)

BATCH_PRIORITY = TIERS[BACKGROUND_TIER]

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


class BatchRequestRunner:
    def __init__(self, state: ServerState) -> None:
        self.completions = OpenAIServingCompletion(state)
        self.chat = OpenAIServingChat(state)

    async def run(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, response body) of the line's request; failures are answers too, in OpenAI's error
        shape. Cancelling the call aborts the request in the engine."""
        try:
            if url == CHAT_COMPLETIONS_URL:
                chat = _validated(ChatCompletionRequest, body)
                response = await self.chat.create_chat_completion(_at_batch_tier(chat), _line_request(url))
            elif url == COMPLETIONS_URL:
                completion = _validated(CompletionRequest, body)
                response = await self.completions.create_completion(
                    _at_batch_tier(completion), _line_request(url)
                )
            else:
                raise BadRequestError(f"{url} cannot be batched", param="url")
        except OpenAIError as exc:
            return exc.status_code, exc.body()
        except EngineError as exc:
            error = from_engine_error(exc)
            return error.status_code, error.body()
        except Exception as exc:
            # A line's unexpected fault is its own answer, as a request's is its own 500: never the batch's.
            logger.exception("a batch line to %s failed", url)
            error = InternalServerError(f"internal error: {type(exc).__name__}")
            return error.status_code, error.body()
        return response.status_code, json.loads(bytes(response.body))


def _validated(model: type[Body], body: dict[str, Any]) -> Body:
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if request.stream:
        raise BadRequestError("stream is not supported in a batch", param="stream")
    return request


def _at_batch_tier(request: Body) -> Body:
    # Batch lines take only the capacity interactive traffic leaves, whatever tier they name.
    request.priority = BATCH_PRIORITY
    return request


async def _never_disconnects() -> dict[str, Any]:
    # Nobody is connected to a batch line: it runs until it finishes or its caller cancels it.
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _line_request(url: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": url, "headers": []}, _never_disconnects)
