"""What the server tests share: OpenAI-shaped errors, a request that must run on unharmed beside them, and
long streams that hold a server's sequences."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from servers import ServerProcess

# Long enough to outlast the bad requests of a test, short enough to keep the tests quick.
BESIDE_MAX_TOKENS = 1000
RUNNING, WAITING = "kvfleet:num_requests_running", "kvfleet:num_requests_waiting"
# As long as the tiny model's context allows after a short prompt: a second or two each.
OCCUPANT_TOKENS = 2040
WAIT_S = 180.0


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The error of an OpenAI-shaped error response with the given status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_itself_first(logprobs: Any, limit: int) -> None:
    """A completion's logprobs as OpenAI's legacy API answers them: each token's top_logprobs name it first,
    with its logprob, then the `limit` likeliest tokens, best first (`limit + 1` in all where `limit` of
    them outscore it)."""
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for token, logprob, top in rows:
        if logprob is None:  # an echoed prompt's first token
            assert top is None
            continue
        (first, *others) = top.items()
        assert first == (token, logprob)
        scores = [score for _, score in others]
        assert scores == sorted(scores, reverse=True)
        assert len(top) == limit + (sum(score > logprob for score in scores) >= limit)


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    """Waits until nothing runs or waits and every KV block is free; the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = metrics["kvfleet:num_requests_running"] == 0 and metrics["kvfleet:num_requests_waiting"] == 0
        if idle and metrics["kvfleet:kv_cache_usage_perc"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"requests are still running: {metrics}")
        time.sleep(0.01)


def finished_count(server: ServerProcess, reason: str) -> float:
    """How many requests have finished for `reason` (stop, length, abort, ...)."""
    text = httpx.get(f"{server.url}/metrics").text
    prefix = f'vllm:request_success_total{{finished_reason="{reason}",model_name="{server.model_name}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


@dataclass
class RequestBeside:
    """A streamed completion running beside a test's bad requests: it has produced its first tokens before
    the `with` block runs, and must then end normally, with every token it asked for.

    `running` says whether it is still being served; a test checks it once its bad requests are answered,
    which shows they were handled while it ran.
    """

    server: ServerProcess
    max_tokens: int = BESIDE_MAX_TOKENS
    # The model it names: the served one by default, or a LoRA adapter.
    model: str | None = None
    status: int | None = None
    events: list[dict] = field(default_factory=list)
    last_line: str = ""
    _error: BaseException | None = None
    _started: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def __enter__(self) -> RequestBeside:
        self._thread = threading.Thread(target=self._stream, daemon=True)
        self._thread.start()
        self._started.wait(WAIT_S)
        if self._error is not None:
            raise self._error
        assert self.running, f"it ended before any test request was sent: {self.status} {self.events[-2:]}"
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._thread.join(WAIT_S)
        if kind is not None:
            return
        assert not self._thread.is_alive(), "the request beside never finished"
        if self._error is not None:
            raise self._error
        assert self.status == 200, self.events
        assert self.last_line == "data: [DONE]", self.last_line
        assert all("error" not in event for event in self.events), self.events
        finish_reasons = [choice["finish_reason"] for event in self.events for choice in event["choices"]]
        assert finish_reasons[-1] == "length" and not any(finish_reasons[:-1]), finish_reasons[-3:]
        assert self.events[-1]["usage"]["completion_tokens"] == self.max_tokens

    def _stream(self) -> None:
        body = {
            "model": self.model or self.server.model_name,
            "prompt": "go on",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"{self.server.url}/v1/completions"
        try:
            with httpx.stream("POST", url, json=body, headers=self.server.headers(), timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    self.last_line = line or self.last_line
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[len("data: ") :]))
                        self._started.set()
        except BaseException as error:
            self._error = error
        finally:
            self._done.set()
            self._started.set()


# A chat content part that carries media -> the part a processor's chat template takes in its place.
_TEMPLATE_PARTS = {"image_url": {"type": "image"}, "input_audio": {"type": "audio"}}


def transformers_chat_answer(
    model_class: Any, folder: Path, messages: list[dict[str, Any]], max_tokens: int, **media: Any
) -> tuple[str, int]:
    """(greedy answer text, prompt tokens) of Transformers' processor and model (`model_class`) for the
    chat messages, whose media parts' decoded contents `media` holds (images=..., audio=... and
    sampling_rate=...)."""
    import torch
    from transformers import AutoProcessor

    # The Pillow image processors, which the server's resizing follows (with torchvision installed,
    # Transformers would pick its torchvision ones).
    processor = AutoProcessor.from_pretrained(folder, use_fast=False)
    model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    conversation = [
        {
            "role": message["role"],
            "content": [_TEMPLATE_PARTS.get(part["type"], part) for part in message["content"]]
            if isinstance(message["content"], list)
            else [{"type": "text", "text": message["content"]}],
        }
        for message in messages
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    # The rendered template holds any BOS token already.
    inputs = processor(text=text, return_tensors="pt", add_special_tokens=False, **media)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    answer = processor.tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True)
    return answer, prompt_length


def encoder_runs(server: ServerProcess) -> float:
    """The server's kvfleet:mm_encoder_runs."""
    return next(
        value for name, value in server.metrics().items() if name.startswith("kvfleet:mm_encoder_runs")
    )


async def until_metrics(server: ServerProcess, names: tuple[str, ...], value: float) -> None:
    """Waits until the metrics `names` add up to `value`."""
    for _ in range(2000):
        metrics = await asyncio.to_thread(server.metrics)
        if sum(metrics[name] for name in names) == value:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{' + '.join(names)} never reached {value}")


@contextlib.asynccontextmanager
async def occupied(
    server: ServerProcess, prompts: Sequence[str], max_tokens: int = OCCUPANT_TOKENS
) -> AsyncIterator[None]:
    """A server that runs one sequence at a time held by long streams, one a prompt, the first running (its
    first tokens out) and the others queued behind it in order, while the block runs; their clients leave
    after."""
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    first_tokens = asyncio.Event()

    async def occupy(client: httpx.AsyncClient, prompt: str) -> None:
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                first_tokens.set()

    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as client:
        occupants = []
        for started, prompt in enumerate(prompts, start=1):
            occupants.append(asyncio.create_task(occupy(client, prompt)))
            if started == 1:
                await asyncio.wait_for(first_tokens.wait(), 60)
            await until_metrics(server, (RUNNING, WAITING), started)
        try:
            yield
        finally:
            assert not occupants[-1].done(), "the occupants all ended while the test still held them"
            for occupant in occupants:
                occupant.cancel()
            await asyncio.gather(*occupants, return_exceptions=True)


class ScriptedChatStream:
    """Stands in for the service of a route that translates a chat stream: streams these chunks, ending with
    `error` raised when one is given."""

    def __init__(self, chunks: list[dict[str, Any]], error: Exception | None = None) -> None:
        self.chunks, self.error = chunks, error

    async def stream(self, request: Any) -> AsyncIterator[dict[str, Any]]:
        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for chunk in self.chunks:
                yield chunk
            if self.error is not None:
                raise self.error

        return chunks()


def chat_delta(
    delta: dict[str, Any], finish_reason: str | None = None, stop_reason: Any = None
) -> dict[str, Any]:
    """A chat stream's chunk of one choice's delta."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"choices": [choice]}


# A chat stream's text, then a call of get_weather, then the usage (with the cache's share of the prompt).
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
TEXT_THEN_CALL_CHUNKS = [
    chat_delta({"content": "Let me "}),
    chat_delta({"content": "look."}),
    chat_delta({"tool_calls": [CALL]}),
    chat_delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chat_delta({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls"),
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 9,
            "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    },
]
ROLE_CHUNK = chat_delta({"role": "assistant", "content": ""})
