"""What the gateway reads from a request before routing it: the model, the tier, whether it streams, and the
text its prefix-aware routing hashes.

Only what routing needs is checked here; the replica validates the rest. A body that fails these checks is
refused before any replica sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.contract.errors import BadRequestError
from kvfleet.contract.tiers import PRIORITY_HEADER, parse_priority
from kvfleet.runtime import json_depth

# The relative deadline a client may give: milliseconds the request may wait in the gateway for a replica.
DEADLINE_HEADER = "x-kvfleet-deadline-ms"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class RoutedRequest:
    model: str
    # The tier's engine priority (0 = critical), None when the request names none.
    priority: int | None
    stream: bool
    # The prompt as text, in order: the messages' roles and contents, or the completion prompt.
    prompt_text: str
    deadline_seconds: float | None
    # The body as parsed, for the gateway to rename the model in.
    payload: dict[str, Any] = field(compare=False, repr=False)


def parse_request(path: str, body: bytes, headers: Mapping[str, str]) -> RoutedRequest:
    """The routing facts of a completion request; BadRequestError names the field at fault."""
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
    prompt_text = _chat_text(payload) if path == CHAT_PATH else _completion_text(payload)
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
    prompt = payload.get("prompt")
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
        "prompt must be a string, a list of strings, or token ids (a list of integers or of lists)",
        param="prompt",
    )


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
