"""A batch line answered by the OpenAI service, as its HTTP route would answer it, at the `batch` tier: the
offline runner and the Batch API both answer lines this way."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from kvfleet.contract.errors import BadRequestError, InternalServerError, OpenAIError
from kvfleet.contract.tiers import BACKGROUND_TIER, TIERS
from kvfleet.runtime.batch.lines import CHAT_COMPLETIONS_URL, COMPLETIONS_URL
from kvfleet.runtime.errors import EngineError
from kvfleet.runtime.serving.errors import from_engine_error, validation_error
from kvfleet.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.runtime.serving.service import OpenAIService
from pydantic import ValidationError

logger = logging.getLogger(__name__)

_BATCH_PRIORITY = TIERS[BACKGROUND_TIER]

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


async def answer_line(service: OpenAIService, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(HTTP status, response body) of the line's request; failures are answers too, in OpenAI's error
    shape. Cancelling the call aborts the request in the engine."""
    try:
        if url == CHAT_COMPLETIONS_URL:
            request = await service.create_chat_completion(
                _at_batch_tier(_validated(ChatCompletionRequest, body))
            )
        elif url == COMPLETIONS_URL:
            request = await service.create_completion(_at_batch_tier(_validated(CompletionRequest, body)))
        else:
            raise BadRequestError(f"{url} cannot be batched", param="url")
        return 200, await service.complete(request)
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
    request.priority = _BATCH_PRIORITY
    return request
