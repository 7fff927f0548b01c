"""A replica that answers completions and chat completions from a fixed script of tokens, in the chunk format
of `kvfleet serve` (kvfleet.runtime.serving: the chat role preamble, `return_token_ids` carriers, held-back
text of a possible stop string, log probabilities, tool-call deltas, the usage chunk, error frames and
[DONE]), that continues a request from a `continuation` as a replica does (the resumed tokens replayed
through the same state, their output discarded), and that fails on cue: for the gateway's resume tests.

Token `i` of choice `c` has the id `token_id(c, i)` and the text the script gives it; a continuation whose
tokens are not the script's is refused with 400, so a gateway that sends the wrong ones cannot pass.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web
from kvfleet.contract.errors import (
    BadRequestError,
    InternalServerError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from kvfleet.contract.resume import CONTINUATION, CONTINUATION_CHOICES, DRAINING_CODE

# The comment `kvfleet serve --sse-keep-alive-interval` sends (as vLLM's server does).
KEEP_ALIVE = b": keep-alive\n\n"
FaultKind = Literal["reset", "eof", "error", "drain", "stall", "refuse", "draining", "timeout", "nan"]
TOOL_NAME = "get_weather"
# A tool call's script: two tokens before its name is known, its arguments, one token closing it.
TOOL_HEADER_TOKENS = 2
TOOL_SCRIPT = [
    "<tool_call>",
    '{"name": "get_weather", "arguments": ',
    '{"city',
    '": "Par',
    "is",
    '"}',
    "}</tool_call>",
]


@dataclass
class Fault:
    """What a replica does to the next `times` requests (None: every one) after streaming `after` steps (a
    step: one token of each choice not finished; past the last, after the last token before [DONE])."""

    kind: FaultKind
    after: int = 0
    times: int | None = 1
    # Strikes after the usage chunk (when asked for), the last before [DONE]; or after the chat role of the
    # first choice, before the others' (`after` is then not read).
    after_usage: bool = False
    after_first_role: bool = False


def token_id(choice: int, position: int) -> int:
    return 1000 * (choice + 1) + position


def default_script(body: dict[str, Any], choice: int) -> list[str]:
    """Each choice's own words, the later choices longer."""
    return [f" w{choice}.{position}" for position in range(6 + 3 * choice)]


Script = Callable[[dict[str, Any], int], list[str]]


@dataclass
class _Delta:
    """What one token adds to a choice, as the engine's CompletionOutput delta."""

    index: int
    token_ids: list[int]
    text: str
    logprob: float | None
    finish_reason: str | None = None
    stop_reason: str | None = None


class _Run:
    """One choice's generation: its tokens, text released, held back (a possible stop string) and end."""

    def __init__(self, index: int, script: list[str], body: dict[str, Any]) -> None:
        self.index = index
        self.script = script
        stop = body.get("stop") or []
        self.stops = [stop] if isinstance(stop, str) else list(stop)
        self.max_tokens = body.get("max_tokens") or 10_000
        self.logprobs = bool(body.get("logprobs"))
        self.position = 0
        self.text = ""
        self.released = 0
        self.finish_reason: str | None = None

    def step(self) -> _Delta:
        position = self.position
        self.position += 1
        self.text += self.script[position]
        logprob = -0.5 - position / 100 if self.logprobs else None
        delta = _Delta(self.index, [token_id(self.index, position)], "", logprob)
        found = [self.text.find(stop, self.released) for stop in self.stops]
        hits = [(at, stop) for at, stop in zip(found, self.stops, strict=True) if at >= 0]
        if hits:
            at, stop = min(hits)
            delta.text, self.released = self.text[self.released : at], at
            delta.finish_reason, delta.stop_reason = "stop", stop
        elif self.position == len(self.script) or self.position == self.max_tokens:
            delta.text, self.released = self.text[self.released :], len(self.text)
            delta.finish_reason = "stop" if self.position == len(self.script) else "length"
        else:
            end = len(self.text) - _held(self.text[self.released :], self.stops)
            delta.text, self.released = self.text[self.released : end], end
        self.finish_reason = delta.finish_reason
        return delta


def _held(unreleased: str, stops: list[str]) -> int:
    """The characters at the end that may begin a stop string."""
    return max(
        (size for stop in stops for size in range(1, len(stop)) if unreleased.endswith(stop[:size])),
        default=0,
    )


class _Builder:
    """The chunk choices of each delta, as the replica's route builds them."""

    def __init__(self, body: dict[str, Any], chat: bool, prompt_ids: list[int]) -> None:
        self.body = body
        self.chat = chat
        self.prompt_ids = prompt_ids
        self.token_ids = body.get("return_token_ids") is True
        self.tools = chat and bool(body.get("tools"))
        self.text_offsets: dict[int, int] = {}
        self.started: set[int] = set()
        self.tool_tokens: dict[int, int] = {}

    def choices(self, delta: _Delta) -> list[dict[str, Any]]:
        finished = delta.finish_reason is not None
        if self.tools:
            built = self._tool_choices(delta, finished)
        elif self.chat:
            built = self._chat_choices(delta, finished)
        else:
            return self._completion_choices(delta, finished)
        if self.token_ids:
            built = built or [{"index": delta.index, "delta": {}, "logprobs": None}]
            built[-1] = {**built[-1], "token_ids": delta.token_ids}
        return built

    def _completion_choices(self, delta: _Delta, finished: bool) -> list[dict[str, Any]]:
        offset = self.text_offsets.get(delta.index, 0)
        self.text_offsets[delta.index] = offset + len(delta.text)
        if not (delta.text or finished or delta.logprob is not None or self.token_ids):
            return []
        logprobs = None
        if delta.logprob is not None:
            token = self._token_text(delta)
            logprobs = {"tokens": [token], "token_logprobs": [delta.logprob],
                        "top_logprobs": [{token: delta.logprob}], "text_offset": [offset]}  # fmt: skip
        choice: dict[str, Any] = {"index": delta.index, "text": delta.text, "logprobs": logprobs}
        if self.token_ids:
            if delta.index not in self.started:
                choice["prompt_token_ids"] = self.prompt_ids
            choice["token_ids"] = delta.token_ids
        self.started.add(delta.index)
        return [choice]

    def _chat_choices(self, delta: _Delta, finished: bool) -> list[dict[str, Any]]:
        if not (delta.text or finished or delta.logprob is not None):
            return []
        logprobs = None
        if delta.logprob is not None:
            token = self._token_text(delta)
            entry = {"token": token, "logprob": delta.logprob, "bytes": list(token.encode())}
            logprobs = {"content": [{**entry, "top_logprobs": [entry]}]}
        content = {"content": delta.text} if delta.text else {}
        return [{"index": delta.index, "delta": content, "logprobs": logprobs}]

    def _tool_choices(self, delta: _Delta, finished: bool) -> list[dict[str, Any]]:
        seen = self.tool_tokens[delta.index] = self.tool_tokens.get(delta.index, 0) + 1
        deltas: list[dict[str, Any]] = []
        if seen == TOOL_HEADER_TOKENS:
            function = {"name": TOOL_NAME, "arguments": ""}
            call = {"index": 0, "id": f"call_{delta.index}", "type": "function", "function": function}
            deltas.append({"tool_calls": [call]})
        elif TOOL_HEADER_TOKENS < seen < len(TOOL_SCRIPT):
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": self._token_text(delta)}}]})
        choices = [{"index": delta.index, "delta": d, "logprobs": None} for d in deltas]
        return choices or ([{"index": delta.index, "delta": {}, "logprobs": None}] if finished else [])

    def _token_text(self, delta: _Delta) -> str:
        position = delta.token_ids[0] % 1000
        return self.script_of(delta.index)[position]

    script_of: Callable[[int], list[str]]


@dataclass
class ScriptedReplica:
    """A replica answering from `script`; `faults` are used up in order, one a request."""

    name: str
    number: int = 0
    script: Script = default_script
    faults: list[Fault] = field(default_factory=list)
    # Sends the chat roles for a continuation too, which a replica need not (the gateway drops them).
    roles_on_continuation: bool = False
    received: list[dict[str, Any]] = field(default_factory=list)
    # The address each request came from: a connection kept for another request keeps its port.
    peers: list[Any] = field(default_factory=list)
    # Seconds between a stream's [DONE] and its end, as a slow network may hold them apart.
    end_after_done_s: float = 0.0
    # Before each chunk of a stream, this many keep-alive comments, each after keep_alive_s seconds: a slow
    # replica's stream with --sse-keep-alive-interval.
    keep_alives_per_chunk: int = 0
    keep_alive_s: float = 0.0
    keep_alives_sent: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None
    _requests: int = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def continuations(self) -> list[dict[str, Any]]:
        return [body[CONTINUATION] for body in self.received if CONTINUATION in body]

    def _fault(self) -> Fault | None:
        if not self.faults:
            return None
        fault = self.faults[0]
        if fault.times is not None:
            fault.times -= 1
            if fault.times == 0:
                self.faults.pop(0)
        return fault

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        self._requests += 1
        chat = request.path.endswith("/chat/completions")
        fault = self._fault()
        if fault is not None and fault.kind in ("refuse", "draining"):
            error = (
                ServiceUnavailableError("the server is draining", code=DRAINING_CODE)
                if fault.kind == "draining"
                else ServiceUnavailableError("loading", code="not_ready")
            )
            return web.json_response(error.body(), status=error.status_code)
        try:
            answer = _Answer(self, body, chat)
        except BadRequestError as error:
            return web.json_response(error.body(), status=error.status_code)
        if not body.get("stream"):
            return web.json_response(answer.whole())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-replica": self.name})
        await response.prepare(request)
        for chunk in answer.stream(fault):
            if isinstance(chunk, Fault):
                return await _fail(request, response, chunk.kind)
            for _ in range(self.keep_alives_per_chunk):
                await asyncio.sleep(self.keep_alive_s)
                await response.write(KEEP_ALIVE)
                self.keep_alives_sent += 1
            await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        if self.end_after_done_s:
            await asyncio.sleep(self.end_after_done_s)
        await response.write_eof()
        return response


async def _fail(request: web.Request, response: web.StreamResponse, kind: FaultKind) -> web.StreamResponse:
    if kind == "reset":
        assert request.transport is not None
        request.transport.abort()
    elif kind == "stall":
        await asyncio.Event().wait()  # until the gateway gives up on it
    elif kind in ("error", "drain", "timeout"):
        error = {
            "drain": ServiceUnavailableError(
                "the server shut down before the request finished", code=DRAINING_CODE
            ),
            "error": InternalServerError("the model failed while running this request"),
            "timeout": RequestTimeoutError("the request did not finish within its timeout", code="timeout"),
        }[kind]
        await response.write(error.to_sse().encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    elif kind == "nan":
        # A chunk as Python's json writes a NaN logprob: not JSON, though json.loads reads it.
        await response.write(b'data: {"choices": [{"index": 0, "text": "", "logprobs": NaN}]}\n\n')
        await response.write_eof()
    else:  # eof: the body ends cleanly, without [DONE]
        await response.write_eof()
    return response


class _Answer:
    """One request's answer: its runs (resumed from the continuation) and how it is framed."""

    def __init__(self, replica: ScriptedReplica, body: dict[str, Any], chat: bool) -> None:
        self.body = body
        self.chat = chat
        self.n = body.get("n") or 1
        self.scripts = [replica.script(body, index) for index in range(self.n)]
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{replica.name}-{replica._requests}"
        self.created = 1_700_000_000 + replica.number
        text = json.dumps(body.get("messages") or body.get("prompt"))
        self.prompt_ids = [ord(character) for character in text[:12]]
        self.runs = [_Run(index, self.scripts[index], body) for index in range(self.n)]
        self.builder = _Builder(body, chat, self.prompt_ids)
        self.builder.script_of = lambda index: self.scripts[index]
        self.roles = not (CONTINUATION in body and not replica.roles_on_continuation)
        self.all_deltas: list[_Delta] = []
        for resumed in (body.get(CONTINUATION) or {}).get(CONTINUATION_CHOICES, []):
            self._replay(resumed)

    def _replay(self, resumed: dict[str, Any]) -> None:
        run = self.runs[resumed["index"]]
        expected = [token_id(run.index, position) for position in range(len(resumed["token_ids"]))]
        if resumed["token_ids"] != expected or not self.body.get("stream"):
            raise BadRequestError("the continuation's tokens are not this answer's", param=CONTINUATION)
        for _ in expected:
            delta = run.step()
            self.all_deltas.append(delta)
            self.builder.choices(delta)
        if resumed["finished"] != (run.finish_reason is not None):
            raise BadRequestError("the continuation's finished flag is wrong", param=CONTINUATION)

    def _steps(self) -> Iterator[list[_Delta]]:
        while any(run.finish_reason is None for run in self.runs):
            deltas = [run.step() for run in self.runs if run.finish_reason is None]
            self.all_deltas.extend(deltas)
            yield deltas

    def chunk(self, choice: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        return {**head, "created": self.created, "model": self.body["model"],
                "choices": [choice] if choice is not None else [], **fields}  # fmt: skip

    def stream(self, fault: Fault | None) -> Iterator[dict[str, Any] | Fault]:
        """The chunks, and the fault (in their place) where it strikes."""
        asked_ids = self.body.get("return_token_ids") is True
        if self.chat and self.roles:
            for index in range(self.n):
                if index == 1 and fault is not None and fault.after_first_role:
                    yield fault
                    return
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                extra = {"prompt_token_ids": self.prompt_ids} if index == 0 and asked_ids else {}
                yield self.chunk({**role, "finish_reason": None}, **extra)
        for number, deltas in enumerate(self._steps()):
            if fault is not None and number == fault.after:
                yield fault
                return
            for delta in deltas:
                choices = self.builder.choices(delta)
                for place, choice in enumerate(choices, start=1):
                    reasons: dict[str, Any] = {"finish_reason": None}
                    if delta.finish_reason is not None and place == len(choices):
                        finish = "tool_calls" if self.builder.tools else delta.finish_reason
                        reasons = {"finish_reason": finish, "stop_reason": delta.stop_reason}
                    yield self.chunk({**reasons, **choice})
        if fault is not None and not fault.after_usage:
            yield fault
            return
        if (self.body.get("stream_options") or {}).get("include_usage"):
            yield self.chunk(None, usage=self.usage())
        if fault is not None:
            yield fault

    def usage(self) -> dict[str, int]:
        completion = sum(len(delta.token_ids) for delta in self.all_deltas)
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer, from the runs' ends (as the replica's route assembles it)."""
        for _ in self._steps():
            pass
        entries = [self._entry(run) for run in self.runs]
        answer = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.body["model"], "choices": entries,
                  "usage": self.usage()}  # fmt: skip
        if self.chat and self.body.get("return_token_ids"):
            answer["prompt_token_ids"] = self.prompt_ids
        return answer

    def _entry(self, run: _Run) -> dict[str, Any]:
        deltas = [delta for delta in self.all_deltas if delta.index == run.index]
        ids = [token for delta in deltas for token in delta.token_ids]
        text = "".join(delta.text for delta in deltas)
        last = deltas[-1]
        entry: dict[str, Any] = {"index": run.index, "finish_reason": last.finish_reason,
                                 "stop_reason": last.stop_reason, "logprobs": None}  # fmt: skip
        tokens = [self.scripts[run.index][token % 1000] for token in ids]
        if self.body.get("logprobs"):
            logprobs = [delta.logprob for delta in deltas]
            if self.chat:
                entries = [
                    {"token": t, "logprob": p, "bytes": list(t.encode())}
                    for t, p in zip(tokens, logprobs, strict=True)
                ]
                entry["logprobs"] = {"content": [{**e, "top_logprobs": [e]} for e in entries]}
            else:
                offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
                entry["logprobs"] = {"tokens": tokens, "token_logprobs": logprobs,
                                     "top_logprobs": [{t: p} for t, p in zip(tokens, logprobs, strict=True)],
                                     "text_offset": offsets}  # fmt: skip
        if self.chat and self.builder.tools:
            arguments = "".join(TOOL_SCRIPT[TOOL_HEADER_TOKENS:-1])
            call = {"id": f"call_{run.index}", "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": arguments}}  # fmt: skip
            entry.update(message={"role": "assistant", "content": None, "tool_calls": [call]})
            entry["finish_reason"] = "tool_calls"
        elif self.chat:
            entry["message"] = {"role": "assistant", "content": text}
        else:
            entry["text"] = text
        if self.body.get("return_token_ids"):
            entry["token_ids"] = ids
            if not self.chat:
                entry["prompt_token_ids"] = self.prompt_ids
        return entry


@asynccontextmanager
async def scripted(*specs: ScriptedReplica) -> AsyncIterator[list[ScriptedReplica]]:
    for number, replica in enumerate(specs):
        replica.number = number
        await replica.start()
    try:
        yield list(specs)
    finally:
        for replica in specs:
            await replica.stop()


def sse_chunks(raw: bytes) -> list[Any]:
    """A stream's events: each chunk's JSON, and "[DONE]" as it comes."""
    events = []
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: "):
            data = event.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def post(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}{path}", json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.read()
