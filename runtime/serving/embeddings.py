"""POST /v1/embeddings: each input's embedding, pooled as vLLM pools a decoder model's for its embed task:
the final hidden state of the input's last token, L2-normalized.

Embeddings are served beside generation, by the same engine and weights: an input runs as a completion
prompt of one token, admitted like any other (model, priority, context, guardrails), and the engine returns
its last hidden state with that token.
"""

from __future__ import annotations

import base64
import contextlib
import math
import struct
import uuid
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.serving.completions import CompletionRoute
from kvfleet.runtime.serving.protocol import EmbeddingRequest
from kvfleet.runtime.serving.responses import finish_error

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService


class _EmbeddingPromptRoute(CompletionRoute):
    id_prefix = "embd"


class OpenAIServingEmbedding:
    def __init__(self, service: OpenAIService) -> None:
        self.service = service

    async def create_embedding(self, body: EmbeddingRequest, priority_header: str | None) -> dict[str, Any]:
        body.check()
        request = await self.service.admit(_EmbeddingPromptRoute(body.completion_request()), priority_header)
        request.params.return_prompt_hidden_state = True
        hidden_states: dict[str, list[float]] = {}
        async with contextlib.aclosing(self.service.outputs(request)) as outputs:
            async for output in outputs:
                for completion in output.outputs:
                    error = finish_error(completion.finish_reason)
                    if error is not None:
                        raise error
                if output.prompt_hidden_state is not None:
                    hidden_states[output.request_id] = output.prompt_hidden_state
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(_normalized(hidden_states[request_id]), body.encoding_format),
            }
            for index, request_id in enumerate(request.engine_request_ids)
        ]
        prompt_tokens = sum(len(token_ids) for token_ids in request.prompt_token_ids)
        return {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": request.created,
            "model": request.model,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return [value / norm for value in vector] if norm > 0 else vector


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as OpenAI's base64: little-endian float32s."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
