"""The bodies the service answers with, built from the engine's outputs: pure functions of their inputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfleet.contract.errors import (
    InternalServerError,
    OpenAIError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from kvfleet.runtime.engine.outputs import CompletionOutput
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.serving.token_names import TokenNames

if TYPE_CHECKING:
    from kvfleet.runtime.serving.request import PreparedRequest


@dataclass
class Choice:
    """One generated sequence, accumulated from delta outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (vLLM's field); None for any other end.
    stop_reason: int | str | None = None
    # Its prompt's logprobs (RequestOutput.prompt_logprobs), where the request asked for them.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text += completion.text
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            self.logprobs = (self.logprobs or []) + completion.logprobs
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason


# (prompt index, delta, whether it finished the sequence) -> the choices to stream, one chunk each (none: send
# nothing).
ChoiceBuilder = Callable[[int, CompletionOutput, bool], list[dict[str, Any]]]


def finish_error(finish_reason: str | None) -> OpenAIError | None:
    """Finish reasons that are failures, not answers."""
    if finish_reason == "timeout":
        return RequestTimeoutError("the request did not finish within its timeout", code="timeout")
    if finish_reason == "error":
        return InternalServerError("the model failed while running this request")
    if finish_reason == "abort":
        return ServiceUnavailableError("the request was stopped by the server", code="aborted")
    return None


def chunk(
    request: PreparedRequest, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One streamed chunk: a choice's delta, or (with no choice) the usage that ends the stream."""
    body: dict[str, Any] = {
        "id": request.request_id,
        "object": request.route.chunk_object,
        "created": request.created,
        "model": request.model,
        "choices": [choice] if choice is not None else [],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def answered_logprob(logprob: float) -> float:
    """A logprob as an answer carries it: JSON has no -inf, the score of a token the sampling settings ruled
    out (processed logprobs modes), so such a token scores vLLM's -9999.0."""
    return max(logprob, -9999.0)


def token_id_name(token_id: int) -> str:
    """vLLM's name for a token in logprobs asked with return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


def prompt_logprobs_body(
    tokenizer: Any, prompt_token_ids: list[int], prompt_logprobs: list[PromptTokenLogprobs | None]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: for each prompt token, itself and the likeliest tokens by id, each with its
    logprob, rank and text (None for the first token, which nothing before it scores)."""
    body: list[dict[str, dict[str, Any]] | None] = []
    names = TokenNames(tokenizer)
    for token_id, scores in zip(prompt_token_ids, prompt_logprobs, strict=True):
        if scores is None:
            body.append(None)
            continue
        named = names.next(token_id, scores.logprobs)
        # The others are the likeliest of all, so their order is their rank.
        ranked = sorted(scores.logprobs.items(), key=lambda item: item[1], reverse=True)
        ranks = {other: rank for rank, (other, _) in enumerate(ranked, start=1)} | {token_id: scores.rank}
        body.append(
            {
                str(other): {
                    "logprob": answered_logprob(scores.logprobs[other]),
                    "rank": ranks[other],
                    "decoded_token": named[other],
                }
                for other in {token_id: None, **ranks}
            }
        )
    return body


def top_logprobs(
    names: Mapping[int, str], logprobs: dict[int, float], limit: int, as_ids: bool
) -> list[tuple[str, float]]:
    """The `limit` likeliest tokens, by name (their text, or token_id_name), with their answered logprobs."""
    best = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:limit]
    return _named(names, best, as_ids)


def completion_top_logprobs(
    names: Mapping[int, str], logprobs: dict[int, float], token_id: int, limit: int, as_ids: bool
) -> dict[str, float]:
    """A completion token's top_logprobs as OpenAI's legacy API and vLLM answer them: the token itself first,
    then the `limit` likeliest (`limit + 1` in all when the token is not among them)."""
    best = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:limit]
    itself_first = {token_id: logprobs[token_id], **dict(best)}
    return dict(_named(names, list(itself_first.items()), as_ids))


def _named(
    names: Mapping[int, str], scored: list[tuple[int, float]], as_ids: bool
) -> list[tuple[str, float]]:
    return [
        (token_id_name(token_id) if as_ids else names[token_id], answered_logprob(logprob))
        for token_id, logprob in scored
    ]
