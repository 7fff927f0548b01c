"""One client stream made of the streams of several replicas: what the gateway forwards of a generation, and
the continuation that lets another replica go on from there.

The gateway asks a replica for every completion and chat completion as a stream with `return_token_ids`, so
each chunk names the tokens it carries. Per choice, the splice keeps the ids of every token received and
whether the choice finished; that is the `continuation` (kvfleet.contract.resume) another replica continues
from when this one fails. Each continuation's chunks are rewritten to the first stream's `id` and `created`;
a role the client has had already is not sent again (a chat choice whose role it has not had gets one), nor
are the prompt's token ids; token ids the client did not ask for are taken out, and a chunk left carrying
nothing is not sent (a replica sends a choice with only token ids while it holds back text that may begin a
stop string). The usage chunk is held until the stream ends: a replica that fails after sending it is
resumed, and the usage the client gets is the last replica's, which counts every token once.

Pure: no I/O. kvfleet.gateway.resumption reads the replicas and writes the client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfleet.contract.errors import (
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    OpenAIError,
    OverloadedError,
    PermissionDeniedError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from kvfleet.contract.resume import CONTINUATION_CHOICES, DRAINING_CODE

DONE = "[DONE]"
# An event longer than this is no chunk a replica sends: the stream is taken as broken.
MAX_EVENT_BYTES = 16 * 1024 * 1024
# Why a stream is resumed elsewhere: its connection broke or ended before [DONE], it sent a 5xx error frame,
# it went silent past the stall timeout, or it handed the request back while draining.
Cause = Literal["reset", "error", "stall", "drain"]
# The error types of the frames a replica's own failure ends a stream with (5xx); the others (a request's own
# timeout, a bad request found late) are the client's answer.
_REPLICA_FAILURES = frozenset({InternalServerError.error_type, ServiceUnavailableError.error_type})
# An error frame's HTTP status, for a non-streamed answer: by its type, as the replica would have answered.
_STATUS_OF_TYPE = {
    error_class.error_type: error_class.status_code
    for error_class in (
        InternalServerError,
        ServiceUnavailableError,
        OverloadedError,
        RequestTimeoutError,
        PermissionDeniedError,
        AuthenticationError,
        NotFoundError,
        BadRequestError,
    )
}


class EventReader:
    """The data of each Server-Sent Event of a byte stream, as each event completes, and its comment lines (a
    replica's keep-alives)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._comments: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The events `chunk` completes; ValueError for an event past MAX_EVENT_BYTES."""
        self._buffer.extend(chunk)
        events = []
        start = 0
        while (end := self._buffer.find(b"\n", start)) >= 0:
            line = bytes(self._buffer[start:end]).rstrip(b"\r")
            start = end + 1
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode())
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[5:].removeprefix(b" "))
            elif line.startswith(b":"):
                self._comments.append(line)
        del self._buffer[:start]
        if len(self._buffer) + sum(len(data) for data in self._data) > MAX_EVENT_BYTES:
            raise ValueError(f"an event longer than {MAX_EVENT_BYTES} bytes")
        return events

    def take_comments(self) -> list[bytes]:
        """The comment lines read since the last call."""
        comments, self._comments = self._comments, []
        return comments


@dataclass(frozen=True)
class Failure:
    """A replica's stream that broke off before its end: resumed elsewhere."""

    cause: Cause
    detail: str


def frame_failure(error: Any) -> Failure | None:
    """The failure an error frame's `error` reports; None when the error is the request's own (the client's
    answer, not resumed)."""
    if not isinstance(error, dict):
        return Failure("error", f"a malformed error frame: {error!r}")
    if error.get("code") == DRAINING_CODE:
        return Failure("drain", str(error.get("message")))
    if error.get("type") in _REPLICA_FAILURES:
        return Failure("error", str(error.get("message")))
    return None


def answered_error(status: int, content: bytes) -> OpenAIError:
    """An error answer (a replica's, or the gateway's own), as the client's."""
    try:
        error = json.loads(content)["error"]
        raised = frame_error(error)
    except (ValueError, KeyError, TypeError, AttributeError):
        raised = OpenAIError(content.decode(errors="replace") or f"the replica answered {status}")
    raised.status_code = status
    return raised


def frame_error(error: dict[str, Any]) -> OpenAIError:
    """An error frame's error, with the status a non-streamed answer gives it."""
    raised = OpenAIError(str(error.get("message")), param=error.get("param"), code=error.get("code"))
    raised.error_type = str(error.get("type"))
    raised.status_code = _STATUS_OF_TYPE.get(raised.error_type, InternalServerError.status_code)
    return raised


@dataclass
class _Progress:
    """One choice's tokens received and what the client has had of it."""

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    role_sent: bool = False
    prompt_ids_sent: bool = False


class Splice:
    """The client's view of a generation served by one replica after another."""

    def __init__(self, chat: bool, n: int, token_ids_asked: bool) -> None:
        """`chat`: a chat completion (else a completion) of `n` choices; `token_ids_asked`: whether the client
        asked for the token ids (`return_token_ids`)."""
        self.chat = chat
        self.n = n
        self.token_ids_asked = token_ids_asked
        self.id: Any = None
        self.created: Any = None
        self.usage: dict[str, Any] | None = None
        self._choices: dict[int, _Progress] = {}
        self._prompt_ids_sent = False
        # A continuation's first chunk still to come: the chat roles the client has not had go before it.
        self._roles_owed = False

    def continuation(self) -> dict[str, Any] | None:
        """What another replica continues from; None while no choice has begun (it starts afresh)."""
        if not self._choices:
            return None
        self._roles_owed = self.chat
        self.usage = None
        choices = [
            {"index": index, "token_ids": list(progress.token_ids), "finished": progress.finished}
            for index, progress in sorted(self._choices.items())
        ]
        return {CONTINUATION_CHOICES: choices}

    def replayed_tokens(self) -> int:
        """The tokens a continuation has its replica compute again: those of the choices not finished."""
        return sum(len(p.token_ids) for p in self._choices.values() if not p.finished)

    def accept(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to send the client for one of a replica's chunks (none, one, or the roles it is owed
        before it); a usage chunk is held for `ending`."""
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        chunk = {**chunk, "id": self.id, "created": self.created}
        choices = chunk.get("choices") or []
        if not choices and chunk.get("usage") is not None:
            self.usage = chunk
            return []
        kept = [sent for sent in map(self._choice, choices) if sent is not None]
        if not kept:
            return []
        chunk["choices"] = kept
        if "prompt_token_ids" in chunk:
            if self.token_ids_asked and not self._prompt_ids_sent:
                self._prompt_ids_sent = True
            else:
                del chunk["prompt_token_ids"]
        return [*self._owed_roles(chunk), chunk]

    def ending(self) -> list[dict[str, Any]]:
        """What goes before [DONE]: the last replica's usage, when the client asked for it."""
        return [self.usage] if self.usage is not None else []

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        progress = self._choices.setdefault(choice["index"], _Progress())
        progress.token_ids.extend(choice.get("token_ids") or ())
        if choice.get("finish_reason") is not None:
            progress.finished = True
        sent = dict(choice)
        stripped = False
        for name in ("token_ids", "prompt_token_ids"):
            if name in sent and not self.token_ids_asked:
                del sent[name]
                stripped = True
        if "prompt_token_ids" in sent:
            if progress.prompt_ids_sent:
                del sent["prompt_token_ids"]
            progress.prompt_ids_sent = True
        delta = sent.get("delta")
        if isinstance(delta, dict) and "role" in delta:
            if progress.role_sent:
                sent["delta"] = {name: value for name, value in delta.items() if name != "role"}
                stripped = True
            progress.role_sent = True
        return None if stripped and _carries_nothing(sent, self.chat) else sent

    def _owed_roles(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The role chunks of the chat choices the client has had none of, once, before a continuation's
        first chunk."""
        if not self._roles_owed:
            return []
        self._roles_owed = False
        owed = []
        for index in range(self.n):
            progress = self._choices.setdefault(index, _Progress())
            if not progress.role_sent:
                progress.role_sent = True
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                owed.append({**chunk, "choices": [{**role, "finish_reason": None}]})
        for owed_chunk in owed:
            owed_chunk.pop("prompt_token_ids", None)
        return owed


def _carries_nothing(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a choice says nothing to a client: no text, finish, log probabilities or token ids."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if choice.get("token_ids") or choice.get("prompt_token_ids"):
        return False
    return not any((choice.get("delta") or {}).values()) if chat else not choice.get("text")
