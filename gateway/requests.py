"""What the gateway reads from a request before routing it: the model, the tier, whether it streams, and the
text its prefix-aware routing hashes.

Every OpenAI endpoint a replica serves on a model is routed: completions, chat, responses, embeddings, and
vLLM's score and rerank (at each of the paths vLLM serves them); and Anthropic's Messages API, as vLLM serves
it. Only what routing needs is checked here; the replica validates the rest. A body that fails these checks is
refused before any replica sees it.

A response a replica stores lives in that replica's memory, and the gateway sends each request to whichever
replica its policy chooses: a request continuing a stored response (`previous_response_id`) is refused with
the reason, never sent to a replica that would not know the response. The conversation given whole, as
input items, goes to any replica (and to the one caching its prefix, where the policy routes on prefixes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.errors import COUNT_TOKENS_PATH, MESSAGES_PATH, BadRequestError
from kvfleet.contract.scoring import score_sides
from kvfleet.contract.tiers import PRIORITY_HEADER, parse_priority
from kvfleet.runtime import json_depth

# The relative deadline a client may give: milliseconds the request may wait in the gateway for a replica.
DEADLINE_HEADER = "x-kvfleet-deadline-ms"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"
# vLLM's: embeddings in another answer's shape.
POOLING_PATH = "/pooling"
SCORE_PATHS = ("/v1/score", "/score")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
# What the gateway tells a client of the responses it cannot reach.
STORED_RESPONSES_UNREACHABLE = (
    "the gateway does not serve stored responses: each lives in the memory of the replica that answered it, "
    "and the gateway routes every request to any replica of the model; send the conversation as input items "
    "instead"
)


@dataclass(frozen=True)
class RoutedRequest:
    model: str
    # The tier's engine priority (0 = critical), None when the request names none.
    priority: int | None
    stream: bool
    # The prompt as text, in order: the messages' roles and contents (a response's too), the first prompt of a
    # completion or an embedding, the text that others are scored against, or the rerank query.
    prompt_text: str
    deadline_seconds: float | None
    # The body as parsed, for the gateway to rename the model in.
    payload: dict[str, Any] = field(compare=False, repr=False)


def parse_request(path: str, body: bytes, headers: Mapping[str, str]) -> RoutedRequest:
    """The routing facts of a request to one of ROUTED_PATHS; BadRequestError names the field at fault."""
    try:
        payload = json_depth.loads(body)
    except json_depth.JSONTooDeepError as error:
        raise BadRequestError(f"the request body is refused: {error}") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise BadRequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise BadRequestError("the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("model is required and must be a non-empty string", param="model")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequestError("stream must be true or false", param="stream")
    prompt_text = _PROMPT_TEXT[path](payload)
    return RoutedRequest(
        model=model,
        priority=_priority(payload.get("priority"), headers),
        stream=bool(stream),
        prompt_text=prompt_text,
        deadline_seconds=_deadline(headers),
        payload=payload,
    )


def _chat_text(payload: dict[str, Any]) -> str:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list", param="messages")
    parts = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError("each message must be an object with a role", param=f"messages[{index}]")
        parts.append(f"{message['role']}\n{_content_text(message.get('content'))}\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text of its content parts (other parts add nothing to hash)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _completion_text(payload: dict[str, Any]) -> str:
    embeds = payload.get("prompt_embeds")
    if embeds is not None and payload.get("prompt") in (None, ""):
        # Prompt embeddings alone: their base64 text orders the same prompts the same way.
        return _prompts_text(embeds, "prompt_embeds")
    return _prompts_text(payload.get("prompt"), "prompt")


def _embeddings_text(payload: dict[str, Any]) -> str:
    """The first text or token ids of an embedding's input, or its first conversation (vLLM's `messages`, or
    an input of messages) as _chat_text has a chat's."""
    param = "messages" if payload.get("messages") is not None else "input"
    value = payload.get(param)
    if (
        isinstance(value, list)
        and value
        and isinstance(value[0], list)
        and value[0]
        and isinstance(value[0][0], dict)
    ):
        value = value[0]  # a batch of conversations
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return _chat_text({"messages": value})
    return _prompts_text(value, param)


def _prompts_text(prompt: Any, param: str) -> str:
    """The first of a completion's (or an embedding's) prompts as text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        # Token ids: their decimal text orders the same prefixes the same way.
        if isinstance(first, int) and not isinstance(first, bool):
            return " ".join(str(token) for token in prompt)
        if isinstance(first, list):
            return " ".join(str(token) for token in first)
    raise BadRequestError(
        f"{param} must be a string, a list of strings, or token ids (a list of integers or of lists)",
        param=param,
    )


def _responses_text(payload: dict[str, Any]) -> str:
    """The instructions and input as the chat messages the replica makes of them, in _chat_text's form: a
    conversation hashes alike through either API."""
    if payload.get("previous_response_id") is not None:
        raise BadRequestError(STORED_RESPONSES_UNREACHABLE, param="previous_response_id")
    instructions = payload.get("instructions")
    parts = [f"system\n{instructions}\n"] if isinstance(instructions, str) and instructions else []
    items = payload.get("input")
    if isinstance(items, str):
        return "".join([*parts, f"user\n{items}\n"])
    if not isinstance(items, list) or not items:
        raise BadRequestError("input must be a string or a non-empty list of items", param="input")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequestError("each input item must be an object", param=f"input[{index}]")
        parts.append(_item_text(item))
    return "".join(parts)


def _messages_text(payload: dict[str, Any]) -> str:
    """A Messages API conversation in _chat_text's form, its system prompt first as the replica makes it a
    system message: a conversation hashes alike through either API."""
    system = _content_text(payload.get("system"))
    return (f"system\n{system}\n" if system else "") + _chat_text(payload)


def _item_text(item: dict[str, Any]) -> str:
    kind = item.get("type", "message")
    if kind == "function_call":
        return f"assistant\n{item.get('arguments', '')}\n"
    if kind == "function_call_output":
        return f"tool\n{item.get('output', '')}\n"
    return f"{item.get('role', 'user')}\n{_content_text(item.get('content'))}\n"


def _score_text(payload: dict[str, Any]) -> str:
    """The first text the others are scored against."""
    name, _ = score_sides([name for name, value in payload.items() if value is not None])
    first = payload[name]
    if isinstance(first, list) and first and isinstance(first[0], str):
        return first[0]
    if isinstance(first, str):
        return first
    raise BadRequestError(f"{name} must be a string or a non-empty list of strings", param=name)


def _rerank_text(payload: dict[str, Any]) -> str:
    query = payload.get("query")
    if not isinstance(query, str):
        raise BadRequestError("query must be a string", param="query")
    return query


# The paths routed to a model's replicas, and the text of each one's body that routing hashes.
_PROMPT_TEXT: dict[str, Callable[[dict[str, Any]], str]] = {
    CHAT_PATH: _chat_text,
    COMPLETIONS_PATH: _completion_text,
    RESPONSES_PATH: _responses_text,
    MESSAGES_PATH: _messages_text,
    COUNT_TOKENS_PATH: _messages_text,
    EMBEDDINGS_PATH: _embeddings_text,
    POOLING_PATH: _embeddings_text,
    **dict.fromkeys(SCORE_PATHS, _score_text),
    **dict.fromkeys(RERANK_PATHS, _rerank_text),
}
ROUTED_PATHS = tuple(_PROMPT_TEXT)


def _priority(body_priority: Any, headers: Mapping[str, str]) -> int | None:
    """As the replica resolves it: the body's field, else the header."""
    if body_priority is not None:
        source, value = "priority", body_priority
    elif PRIORITY_HEADER in headers:
        source, value = PRIORITY_HEADER, headers[PRIORITY_HEADER]
    else:
        return None
    if not isinstance(value, int | str):
        raise BadRequestError("priority must be a tier name or an integer", param=source)
    try:
        return parse_priority(value)
    except ValueError as error:
        raise BadRequestError(str(error), param=source) from None


def _deadline(headers: Mapping[str, str]) -> float | None:
    value = headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    try:
        milliseconds = int(value.strip())
    except ValueError:
        milliseconds = 0
    if milliseconds <= 0:
        raise BadRequestError(
            f"{DEADLINE_HEADER} must be a positive integer of milliseconds", param=DEADLINE_HEADER
        )
    return milliseconds / 1000
