"""Client traffic to a fleet's pods, the way a Service would route it.

The API server refuses loopback addresses in EndpointSlices, so a Service selecting the local cluster's pods
has no endpoints. ReadyEndpoints plays the endpoints controller instead: the pods that are Ready and not
terminating, re-read a few times a second. ChatLoad sends chat completions through the official openai SDK
to those pods from a few threads and records every outcome.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import openai

from e2e.cluster import KubeAPI
from e2e.fleet.manifests import RUNTIME_PORT, service_selector
from e2e.support.polling import BackgroundPoller
from e2e.support.waits import condition


@dataclass(frozen=True)
class Endpoint:
    pod: str
    ip: str
    port: int = RUNTIME_PORT

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}/v1"


def serving_endpoints(pods: list[dict[str, Any]], port: int = RUNTIME_PORT) -> list[Endpoint]:
    """The pods a Service would send traffic to: Ready, with an IP, and not terminating."""
    endpoints = []
    for pod in pods:
        ready = condition(pod, "Ready")
        ip = pod.get("status", {}).get("podIP")
        if ready and ready["status"] == "True" and ip and not pod["metadata"].get("deletionTimestamp"):
            endpoints.append(Endpoint(pod["metadata"]["name"], ip, port))
    return sorted(endpoints, key=lambda endpoint: endpoint.pod)


class ReadyEndpoints(BackgroundPoller):
    """The serving pods of one InferenceService (or of any `selector` answering on `port`), refreshed every
    `interval` seconds in a thread."""

    def __init__(
        self,
        api: KubeAPI,
        namespace: str,
        service: str,
        interval: float = 0.2,
        *,
        selector: str | None = None,
        port: int = RUNTIME_PORT,
    ) -> None:
        super().__init__(f"endpoints-{service}", interval)
        self._api = api
        self._path = f"/api/v1/namespaces/{namespace}/pods"
        self._selector = selector or service_selector(service)
        self._port = port
        self._endpoints: list[Endpoint] = []

    def poll(self) -> None:
        self.refresh()

    def refresh(self) -> list[Endpoint]:
        pods = self._api.get(self._path, labelSelector=self._selector)["items"]
        endpoints = serving_endpoints(pods, self._port)
        with self._lock:
            self._endpoints = endpoints
        return endpoints

    def current(self) -> list[Endpoint]:
        with self._lock:
            return list(self._endpoints)


@dataclass(frozen=True)
class Outcome:
    """One request: when it ran (monotonic seconds), which pod answered, and its error if it failed."""

    started: float
    finished: float
    pod: str
    error: str | None
    completion_tokens: int = 0


class ChatLoad:
    """`concurrency` closed-loop clients sending chat completions to the serving pods, round robin.

    With no serving pod, a client waits (as a connection to a Service without endpoints would) and the wait
    is counted in `seconds_without_endpoints`.
    """

    def __init__(
        self,
        endpoints: ReadyEndpoints,
        concurrency: int,
        max_tokens: int,
        model: str = "tiny",
        request_timeout: float = 60.0,
        prompt: Callable[[int], str] = lambda number: f"Request {number}: tell me about fleets.",
    ) -> None:
        """`prompt`: the user message of the request of each number."""
        self.endpoints = endpoints
        self.prompt = prompt
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.model = model
        self.request_timeout = request_timeout
        self.outcomes: list[Outcome] = []
        self.seconds_without_endpoints = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counter = itertools.count()
        self._clients: dict[str, openai.OpenAI] = {}
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> ChatLoad:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        for index in range(self.concurrency):
            thread = threading.Thread(target=self._client_loop, name=f"chat-load-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stops sending; requests in flight finish (or time out) first."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.request_timeout + 5)
        self._threads.clear()
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [outcome for outcome in self.outcomes if outcome.error is not None]

    def successes(self) -> list[Outcome]:
        with self._lock:
            return [outcome for outcome in self.outcomes if outcome.error is None]

    def _client(self, endpoint: Endpoint) -> openai.OpenAI:
        with self._lock:
            client = self._clients.get(endpoint.ip)
            if client is None:
                client = openai.OpenAI(
                    base_url=endpoint.base_url,
                    api_key="unused",
                    max_retries=0,
                    timeout=self.request_timeout,
                )
                self._clients[endpoint.ip] = client
            return client

    def _client_loop(self) -> None:
        while not self._stop.is_set():
            available = self.endpoints.current()
            if not available:
                waited = time.monotonic()
                self._stop.wait(0.05)
                with self._lock:
                    self.seconds_without_endpoints += time.monotonic() - waited
                continue
            number = next(self._counter)
            endpoint = available[number % len(available)]
            self._record(endpoint, number)

    def _record(self, endpoint: Endpoint, number: int) -> None:
        started = time.monotonic()
        error: str | None = None
        tokens = 0
        try:
            response = self._client(endpoint).chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": self.prompt(number)}],
                max_tokens=self.max_tokens,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            tokens = response.usage.completion_tokens if response.usage else 0
            if not response.choices or response.choices[0].message.content is None:
                error = "an answer without text"
        except openai.APIError as failure:
            error = f"{type(failure).__name__}: {failure}"
        outcome = Outcome(started, time.monotonic(), endpoint.pod, error, tokens)
        with self._lock:
            self.outcomes.append(outcome)


def chat(endpoint: Endpoint, prompt: str, max_tokens: int = 24, model: str = "tiny") -> str:
    """One chat completion through the openai SDK; returns the answer's text."""
    with openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
        )
    content = response.choices[0].message.content
    if content is None:
        raise AssertionError(f"{endpoint.pod} answered without text: {response}")
    return content
