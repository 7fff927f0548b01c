"""OpenAI batch files, line by line: what an input line must hold, and the records written for each one.

Knows nothing of HTTP or of the engine, so that the offline runner, the server's Batch API and a gateway
spreading a batch over replicas all read and write the same format.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime import json_depth

CHAT_COMPLETIONS_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_COMPLETIONS_URL, COMPLETIONS_URL)

# How a line is answered: (url, body) -> (HTTP status, response body), failures in OpenAI's error shape.
Answer = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


class MalformedLineError(ValueError):
    """The line is not an OpenAI batch request; `param` names the offending field, if one does."""

    def __init__(self, message: str, *, param: str | None = None, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        # The line's custom_id, when it has a usable one despite the fault.
        self.custom_id = custom_id


def parse_line(text: str | bytes, *, endpoint: str | None = None) -> BatchLine:
    """One input line: a JSON object with `custom_id`, `method` POST, `url` (the batch's `endpoint` when
    one is given) and a `body` object naming its `model`."""
    try:
        value = json_depth.loads(text)
    except json_depth.JSONTooDeepError as exc:
        raise MalformedLineError(f"the line is refused: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedLineError(f"the line is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise MalformedLineError("the line must be a JSON object")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise MalformedLineError("custom_id must be a non-empty string", param="custom_id")

    def malformed(message: str, param: str) -> MalformedLineError:
        return MalformedLineError(message, param=param, custom_id=custom_id)

    if value.get("method") != "POST":
        raise malformed("method must be POST", "method")
    url = value.get("url")
    if url not in SUPPORTED_URLS:
        raise malformed(f"url must be one of {', '.join(SUPPORTED_URLS)}, got {url!r}", "url")
    if endpoint is not None and url != endpoint:
        raise malformed(f"url {url!r} is not the batch's endpoint {endpoint!r}", "url")
    body = value.get("body")
    if not isinstance(body, dict):
        raise malformed("body must be a JSON object", "body")
    if not isinstance(body.get("model"), str):
        raise malformed("body.model must name the model", "body.model")
    return BatchLine(custom_id, url, body)


def response_record(custom_id: str | None, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """What a request answered, as a line of the output file (status 200) or of the error file."""
    request_id = body.get("id") if status_code == 200 else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": body,
        },
        "error": None,
    }


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line that never became a request (malformed, cancelled, expired), as a line of the error file."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def record_failed(record: dict[str, Any]) -> bool:
    response = record.get("response")
    return record.get("error") is not None or response is None or response.get("status_code") != 200


def record_line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
