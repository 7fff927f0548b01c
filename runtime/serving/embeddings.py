"""POST /v1/embeddings, and vLLM's /pooling, /score and /rerank on the same embeddings.

An embedding is pooled as vLLM pools a decoder model's for its embed task (kvfleet.runtime.pooler_config):
by default the final hidden state of the input's last token, L2-normalized; cut to a Matryoshka size before
it is normalized. A score is the cosine similarity of two texts' embeddings, as vLLM scores with an
embedding model (not a cross-encoder).

Embeddings are served beside generation (unless the runner serves one alone), by the same engine and
weights: an input runs as a completion prompt of one token, admitted like any other (model, priority,
context, guardrails), and the engine returns its pooled hidden states with that token.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime.pooler_config import EMBED, PoolerConfig, cosine, score_pairs
from kvfleet.runtime.serving.chat import ChatRoute
from kvfleet.runtime.serving.completions import CompletionRoute
from kvfleet.runtime.serving.embedding_encoding import EmbeddingBytes, embedding_bytes, encoded
from kvfleet.runtime.serving.protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    embedding_prompts,
)
from kvfleet.runtime.serving.request import PreparedRequest, RequestHeaders, Route
from kvfleet.runtime.serving.responses import finish_error

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService


# vLLM's embeddings, pooling and score usage count the tokens generated too (none); its rerank usage does
# not.
_NO_COMPLETION = {"completion_tokens": 0}


class _EmbeddingPromptRoute(CompletionRoute):
    id_prefix = "embd"
    task = EMBED


class _EmbeddingChatRoute(ChatRoute):
    id_prefix = "embd"
    task = EMBED


class _PoolingPromptRoute(_EmbeddingPromptRoute):
    id_prefix = "pool"


class _PoolingChatRoute(_EmbeddingChatRoute):
    id_prefix = "pool"


class OpenAIServingEmbedding:
    def __init__(self, service: OpenAIService) -> None:
        self.service = service

    async def create_embedding(
        self, body: EmbeddingRequest, headers: RequestHeaders
    ) -> dict[str, Any] | EmbeddingBytes:
        return await self._answer(body, headers, "embedding", "embedding")

    async def create_pooling(
        self, body: PoolingRequest, headers: RequestHeaders
    ) -> dict[str, Any] | EmbeddingBytes:
        """vLLM's /pooling on an embedding server: its one task's vectors, in the pooling answer's shape."""
        if body.task is not None and body.task != EMBED:
            raise BadRequestError(
                f"task {body.task!r} is not served: this server pools for {EMBED!r} only", param="task"
            )
        if body.dimensions is not None:
            raise BadRequestError("dimensions is not taken on /pooling, as on vLLM's", param="dimensions")
        return await self._answer(body, headers, "pooling", "data")

    async def _answer(
        self, body: EmbeddingRequest, headers: RequestHeaders, item_object: str, vector_field: str
    ) -> dict[str, Any] | EmbeddingBytes:
        """The input's vectors, each an item of `item_object` holding it in `vector_field`, or as bytes."""
        pooler = self._pooler()
        body.check()
        if body.dimensions is not None:
            try:
                pooler.check_dimensions(body.dimensions)
            except ValueError as error:
                raise BadRequestError(str(error), param="dimensions") from None
        requests, pooled = await self._embed_input(body, headers)
        vectors = [pooler.embedding(vector, body.dimensions, body.use_activation) for vector in pooled]
        first = requests[0]
        answer = {
            "id": first.request_id,
            "object": "list",
            "created": first.created,
            "model": first.model,
            "usage": _usage(*requests) | _NO_COMPLETION,
        }
        if body.encoding_format == "bytes" or body.encoding_format == "bytes_only":
            with_metadata = answer if body.encoding_format == "bytes" else None
            return embedding_bytes(vectors, body.embed_dtype, body.endianness, with_metadata)
        data = [
            {
                "object": item_object,
                "index": index,
                vector_field: encoded(vector, body.encoding_format, body.embed_dtype, body.endianness),
            }
            for index, vector in enumerate(vectors)
        ]
        return {**answer, "data": data}

    async def _embed_input(
        self, body: EmbeddingRequest, headers: RequestHeaders
    ) -> tuple[list[PreparedRequest], list[list[float]]]:
        """The request's inputs run for their pooled hidden states: its texts or tokens as one request, or
        each conversation as the chat template renders it (one request each, run together)."""
        prompt_route, chat_route = (
            (_PoolingPromptRoute, _PoolingChatRoute)
            if isinstance(body, PoolingRequest)
            else (_EmbeddingPromptRoute, _EmbeddingChatRoute)
        )
        conversations = body.chat_requests()
        if not conversations:
            prompts = body.completion_request()
            count = len(prompts.prompts())
            fields = ["input"] if count == 1 else [f"input.{index}" for index in range(count)]
            request, vectors = await self._embed(prompt_route(prompts, fields), headers)
            return [request], vectors
        settings = self.service.settings
        try:
            async with (
                asyncio.TaskGroup() as group
            ):  # one failing cancels the others, aborting their requests
                tasks = [
                    group.create_task(self._embed(chat_route(chat, settings), headers))
                    for chat in conversations
                ]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the first failure, answered as it would be alone
        embedded = [task.result() for task in tasks]
        return [request for request, _ in embedded], [vector for _, vectors in embedded for vector in vectors]

    async def create_score(self, body: ScoreRequest, headers: RequestHeaders) -> dict[str, Any]:
        # A first text scored against several is embedded once, as in vLLM, and counted once in the usage.
        (first_name, first), (second_name, second) = body.paired_sides()
        fields = _fields(first_name, getattr(body, first_name), len(first))
        fields += _fields(second_name, getattr(body, second_name), len(second))
        content_tokens = await self._content_tokens(body, len(first), len(second))
        route = _EmbeddingPromptRoute(
            embedding_prompts(first + second, body), fields, content_tokens=content_tokens
        )
        request, vectors = await self._embed(route, headers)
        firsts, seconds = score_pairs(vectors[: len(first)], vectors[len(first) :])
        scores = [cosine(a, b) for a, b in zip(firsts, seconds, strict=True)]
        return {
            "id": request.request_id,
            "object": "list",
            "created": request.created,
            "model": request.model,
            "data": [
                {"index": index, "object": "score", "score": score} for index, score in enumerate(scores)
            ],
            "usage": _usage(request) | _NO_COMPLETION,
        }

    async def rerank(self, body: RerankRequest, headers: RequestHeaders) -> dict[str, Any]:
        documents = body.texts()
        fields = ["query", *_fields("documents", body.documents, len(documents))]
        content_tokens = await self._content_tokens(body, 1, len(documents))
        prompts = embedding_prompts([body.query, *documents], body)
        route = _EmbeddingPromptRoute(prompts, fields, content_tokens=content_tokens)
        request, vectors = await self._embed(route, headers)
        query, embedded = vectors[0], vectors[1:]
        results = [
            {"index": index, "document": {"text": text}, "relevance_score": cosine(query, vector)}
            for index, (text, vector) in enumerate(zip(documents, embedded, strict=True))
        ]
        results.sort(key=lambda result: result["relevance_score"], reverse=True)
        return {
            "id": request.request_id,
            "model": request.model,
            "usage": _usage(request),
            "results": results[: body.top_n or None],
        }

    async def _content_tokens(
        self, body: ScoreRequest | RerankRequest, queries: int, documents: int
    ) -> list[int] | None:
        """How many of its own tokens each query and document keeps (vLLM's max_tokens_per_query and
        max_tokens_per_doc; 0: all), in order; None where both keep all."""
        limits = {
            "max_tokens_per_query": body.max_tokens_per_query,
            "max_tokens_per_doc": body.max_tokens_per_doc,
        }
        if not any(limits.values()):
            return None
        engine = self.service.engine
        await engine.wait_ready(engine.startup_request_timeout)
        max_model_len = self.service.engine_info.max_model_len
        for name, value in limits.items():
            if value >= max_model_len:
                raise BadRequestError(
                    f"{name} ({value}) must be less than this model's maximum context length of "
                    f"{max_model_len} tokens",
                    param=name,
                )
        return [body.max_tokens_per_query] * queries + [body.max_tokens_per_doc] * documents

    def _pooler(self) -> PoolerConfig:
        """How the server pools embeddings, once it is known to serve them."""
        self.service.check_task(EMBED)
        pooler = self.service.pooler
        if pooler.refusal is not None:
            raise BadRequestError(f"embeddings are not served: {pooler.refusal}", param="model")
        return pooler

    async def _embed(
        self, route: Route, headers: RequestHeaders
    ) -> tuple[PreparedRequest, list[list[float]]]:
        """The route's prompts admitted and run for their pooled hidden states, in order."""
        pooler = self._pooler()
        request = await self.service.admit(route, headers)
        request.params.prompt_pooling = pooler.pooling_type
        hidden_states: dict[str, list[float]] = {}
        async with contextlib.aclosing(self.service.outputs(request)) as outputs:
            async for output in outputs:
                for completion in output.outputs:
                    error = finish_error(completion.finish_reason)
                    if error is not None:
                        raise error
                if output.prompt_hidden_state is not None:
                    hidden_states[output.request_id] = output.prompt_hidden_state
        return request, [hidden_states[request_id] for request_id in request.engine_request_ids]


def _fields(name: str, value: str | list[str], count: int) -> list[str]:
    """The field each of `count` texts came from: a list's items, or one text repeated."""
    names = [name] if isinstance(value, str) else [f"{name}.{index}" for index in range(len(value))]
    return names * count if len(names) == 1 else names


def _usage(*requests: PreparedRequest) -> dict[str, int]:
    prompt_tokens = sum(len(token_ids) for request in requests for token_ids in request.prompt_token_ids)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
