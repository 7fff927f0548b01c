"""Streamed chat completions through the fleet gateway, read as an openai SDK client reads them: each answer's
text, tool-call arguments and token ids put together from its chunks, and how it ended.

Every stream asks for its token ids (`return_token_ids`), so that two answers can be compared token for token
and a token sent twice or lost across a resume shows.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import openai

from e2e.fleet.traffic import Endpoint, ReadyEndpoints


@dataclass
class StreamedAnswer:
    text: str = ""
    # The first tool call's arguments, as the deltas spelled them.
    tool_arguments: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Ended as a stream should: a finish reason, usage counting each token it sent once, no error."""
        return (
            self.error is None
            and self.finish_reason is not None
            and self.completion_tokens == len(self.token_ids)
        )


def gateway_client(endpoint: Endpoint, timeout: float = 300.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=timeout)


def stream_chat(
    client: openai.OpenAI,
    model: str,
    request: dict[str, Any],
    on_first_chunk: Callable[[], None] = lambda: None,
    answer: StreamedAnswer | None = None,
) -> StreamedAnswer:
    """One streamed chat completion of `request` (the SDK's arguments, extra_body included), read into
    `answer` as it comes (a new one by default); a failure is the answer's error, never an exception."""
    answer = answer if answer is not None else StreamedAnswer()
    extra_body = {**request.get("extra_body", {}), "return_token_ids": True}
    arguments = {key: value for key, value in request.items() if key != "extra_body"}
    try:
        stream = client.chat.completions.create(
            model=model,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
            **arguments,
        )
        for number, chunk in enumerate(stream):
            if number == 0:
                on_first_chunk()
            if chunk.usage is not None:
                answer.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                _read_choice(answer, choice)
    except openai.APIError as error:
        answer.error = f"{type(error).__name__}: {error}"
    return answer


def _read_choice(answer: StreamedAnswer, choice: Any) -> None:
    answer.token_ids += getattr(choice, "token_ids", None) or []
    answer.text += choice.delta.content or ""
    for call in choice.delta.tool_calls or []:
        if call.index == 0 and call.function is not None:
            answer.tool_arguments += call.function.arguments or ""
    answer.finish_reason = choice.finish_reason or answer.finish_reason


class ConcurrentStreams:
    """Every request streamed at once, each from a thread of its own, spread over the gateway's replicas."""

    def __init__(self, gateway: ReadyEndpoints, model: str, requests: list[dict[str, Any]]) -> None:
        endpoints = gateway.current()
        assert endpoints, "a ready gateway replica"
        self._clients = [gateway_client(endpoint) for endpoint in endpoints]
        # Filled as the chunks arrive, so that how far the streams have got can be read while they run.
        self.answers = [StreamedAnswer() for _ in requests]
        self._threads = [
            threading.Thread(target=self._run, args=(index, model, request), daemon=True)
            for index, request in enumerate(requests)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int, model: str, request: dict[str, Any]) -> None:
        client = self._clients[index % len(self._clients)]
        stream_chat(client, model, request, answer=self.answers[index])

    def finished(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def finish(self, timeout: float) -> list[StreamedAnswer]:
        for thread in self._threads:
            thread.join(timeout)
        assert self.finished(), "a stream hung"
        for client in self._clients:
            client.close()
        return self.answers


class StreamLoad:
    """`concurrency` closed-loop clients streaming the same chat request through the gateway, one after the
    other, recording every answer; `started` counts the streams that got their first chunk."""

    def __init__(
        self,
        gateway: ReadyEndpoints,
        model: str,
        concurrency: int,
        request: dict[str, Any],
        stagger: float = 0.0,
    ) -> None:
        self.gateway = gateway
        # Client i sends its first stream i * stagger seconds in: equal requests started together would end
        # together, every time, and leave moments with no stream in flight.
        self.stagger = stagger
        self.model = model
        self.request = request
        self.answers: list[StreamedAnswer] = []
        self.started = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counter = itertools.count()
        self._threads = [
            threading.Thread(target=self._loop, args=(index,), name=f"stream-load-{index}", daemon=True)
            for index in range(concurrency)
        ]

    def __enter__(self) -> StreamLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop_sending(self) -> None:
        """No new stream from now on; those in flight go on."""
        self._stop.set()

    def stop(self, timeout: float = 300.0) -> None:
        """Stops sending; streams in flight finish first."""
        self.stop_sending()
        for thread in self._threads:
            thread.join(timeout)

    def _loop(self, index: int) -> None:
        clients: dict[str, openai.OpenAI] = {}
        self._stop.wait(index * self.stagger)
        try:
            while not self._stop.is_set():
                endpoints = self.gateway.current()
                if not endpoints:
                    self._stop.wait(0.05)
                    continue
                endpoint = endpoints[next(self._counter) % len(endpoints)]
                client = clients.setdefault(endpoint.ip, gateway_client(endpoint))
                answer = stream_chat(client, self.model, self.request, self._count_start)
                with self._lock:
                    self.answers.append(answer)
        finally:
            for client in clients.values():
                client.close()

    def _count_start(self) -> None:
        with self._lock:
            self.started += 1
