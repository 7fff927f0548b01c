"""Replicas and gateways on real loopback sockets, in the test's own event loop, for the gateway's tests.

The replicas are small aiohttp servers that answer like `kvfleet serve` does (OpenAI JSON, SSE ending with
[DONE], the Responses API's typed events, embeddings, vLLM's score and rerank, the LoRA adapters they serve on
/metrics, and, for a prefill replica, the `kv_transfer_params` of the blocks it holds for a decode replica)
and record what reached them; the gateway under test is the
real one, fed by a discovery source the test publishes through. InferenceServices and pods are built as the
API server returns them, for the Kubernetes discovery.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from kvfleet.contract.scoring import score_sides
from kvfleet.gateway.discovery import ModelConfig, Publish
from kvfleet.gateway.proxy import Gateway

# Safety limits of waits that succeed at once when the code is right; never timed assertions.
WAIT_S = 30.0


class PublishedDiscovery:
    """A discovery source the test drives: what it publishes is what the gateway routes."""

    def __init__(self, models: Mapping[str, ModelConfig]) -> None:
        self.models = dict(models)
        self._publish: Publish | None = None

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        publish(self.models)
        await asyncio.Event().wait()

    def publish(self, models: Mapping[str, ModelConfig]) -> None:
        assert self._publish is not None, "the gateway is running"
        self.models = dict(models)
        self._publish(self.models)


@dataclass
class FakeReplica:
    """A replica: answers completions after a permit (when `gated`), optionally streaming in chunks."""

    name: str
    status: int = 200
    # The `code` of its error answer, when `status` is not 200.
    error_code: str | None = None
    gated: bool = False
    # Streams stop after the first chunk until `resume` is set.
    pause_after_first_chunk: bool = False
    # Streams break off (connection dropped) after the first chunk (a Responses or Messages stream's, within
    # its second event).
    die_after_first_chunk: bool = False
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Mapping[str, str]] = field(default_factory=list)
    permits: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    # The LoRA adapters its /metrics page lists.
    adapters: list[str] = field(default_factory=list)
    # Answers a prefill call (`do_remote_decode`) as a kv_producer engine does: with the kv_transfer_params
    # naming the blocks it holds, each recorded in `offers`.
    offers_kv: bool = False
    offers: list[dict[str, Any]] = field(default_factory=list)
    # Asleep (the runtime's sleep mode) until POST /wake_up, whose headers are recorded in `wake_ups`.
    asleep: bool = False
    wake_ups: list[Mapping[str, str]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        for path, answer in _ANSWERS.items():
            app.router.add_post(path, functools.partial(self._answer, answer))
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.router.add_post("/wake_up", self._wake_up)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.asleep})

    async def _wake_up(self, request: web.Request) -> web.Response:
        self.wake_ups.append(dict(request.headers))
        self.asleep = False
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE kvfleet:lora_adapter_info gauge"]
        lines += [
            f'kvfleet:lora_adapter_info{{model_name="m",lora_name="{name}"}} 1.0' for name in self.adapters
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(dict(request.headers))
        if self.asleep:
            error = {"message": "asleep", "type": "service_unavailable", "param": None, "code": "sleeping"}
            return web.json_response({"error": error}, status=503)
        if self.status != 200:
            return web.json_response(
                {
                    "error": {
                        "message": "busy",
                        "type": "service_unavailable",
                        "param": None,
                        "code": self.error_code,
                    }
                },
                status=self.status,
            )
        try:
            if self.gated:
                await self.permits.acquire()
            if not body.get("stream"):
                answer = _completion(self.name, body)
                if self.offers_kv and (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    answer["kv_transfer_params"] = self._offer(body)
                return web.json_response(answer, headers={"x-replica": self.name})
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "x-replica": self.name}
            )
            await response.prepare(request)
            for index, chunk in enumerate(_chunks(self.name, body)):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if index == 0 and self.die_after_first_chunk:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                if index == 0 and self.pause_after_first_chunk:
                    await self.resume.wait()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            self.disconnected.set()
            raise

    async def _answer(self, answer: Answer, request: web.Request) -> web.StreamResponse:
        """A request of the other endpoints: recorded, and answered (in its replica's name) after a permit
        when `gated`."""
        body = await request.json()
        self.received.append(body)
        self.headers.append(dict(request.headers))
        if self.status != 200:
            return web.json_response(
                {
                    "error": {
                        "message": "busy",
                        "type": "service_unavailable",
                        "param": None,
                        "code": self.error_code,
                    }
                },
                status=self.status,
            )
        if self.gated:
            await self.permits.acquire()
        if not body.get("stream"):
            return web.json_response(answer(self.name, body), headers={"x-replica": self.name})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-replica": self.name})
        await response.prepare(request)
        for index, event in enumerate(_STREAMED_EVENTS[request.path](self.name, body)):
            framed = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            if index == 1 and self.die_after_first_chunk:
                # Within the second event.
                await response.write(framed[: len(framed) // 2])
                assert request.transport is not None
                request.transport.abort()
                return response
            await response.write(framed)
        await response.write_eof()
        return response

    def _offer(self, body: dict[str, Any]) -> dict[str, Any]:
        """Where the prompt's blocks wait, as the engine's prefill answer names them (16-token blocks of a
        prompt taken at 4 characters a token)."""
        prompt = json.dumps(body.get("messages", body.get("prompt")))
        offer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_host": "127.0.0.1",
            "remote_port": 14579,
            "remote_block_ids": list(range(len(prompt) // 64)),
            "remote_request_id": secrets.token_hex(16),
            "tp_size": 1,
        }
        self.offers.append(offer)
        return offer


def _completion(name: str, body: dict[str, Any]) -> dict[str, Any]:
    created = int(time.time())
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if "messages" in body:
        message = {"role": "assistant", "content": name}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        return {"id": f"chatcmpl-{name}", "object": "chat.completion", "created": created,
                "model": body["model"], "choices": [choice], "usage": usage}  # fmt: skip
    choice = {"index": 0, "text": name, "finish_reason": "stop", "logprobs": None}
    return {"id": f"cmpl-{name}", "object": "text_completion", "created": created, "model": body["model"],
            "choices": [choice], "usage": usage}  # fmt: skip


def _response(name: str, body: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A Responses API response whose output text is the replica's name."""
    text = {"type": "output_text", "text": name if status == "completed" else "", "annotations": []}
    message = {
        "type": "message",
        "id": f"msg_{name}",
        "role": "assistant",
        "status": status,
        "content": [text],
    }
    return {"id": f"resp_{name}", "object": "response", "created_at": int(time.time()),
            "model": body["model"], "status": status, "output": [message], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "usage": None}  # fmt: skip


def _response_events(name: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events: created, its text (the replica's name) in one delta, completed."""
    return [
        {"type": "response.created", "sequence_number": 0, "response": _response(name, body, "in_progress")},
        {"type": "response.output_text.delta", "sequence_number": 1, "item_id": f"msg_{name}",
         "output_index": 0, "content_index": 0, "delta": name, "logprobs": []},
        {"type": "response.completed", "sequence_number": 2, "response": _response(name, body)},
    ]  # fmt: skip


def _message(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A Messages API answer whose text is the replica's name."""
    return {"id": f"msg-{name}", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": name}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}  # fmt: skip


def _message_events(name: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed message's events: its start, its text (the replica's name) in one delta, its end."""
    started = {**_message(name, body), "content": [], "stop_reason": None}
    return [
        {"type": "message_start", "message": started},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": name}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]  # fmt: skip


def _counted(name: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": len(name)}


def _embeddings(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """One vector per input, each the replica's name as character codes."""
    texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
    vector = [float(ord(character)) for character in name]
    data = [{"object": "embedding", "index": index, "embedding": vector} for index in range(len(texts))]
    return {
        "object": "list",
        "data": data,
        "model": body["model"],
        "usage": {"prompt_tokens": 1, "total_tokens": 1},
    }


def _scores(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """Each pair scored by the length of its replica's name."""
    _, second = score_sides(body)
    texts = [body[second]] if isinstance(body[second], str) else body[second]
    data = [{"index": index, "object": "score", "score": float(len(name))} for index in range(len(texts))]
    return {"id": f"score-{name}", "object": "list", "model": body["model"], "data": data}


def _reranked(name: str, body: dict[str, Any]) -> dict[str, Any]:
    results = [
        {"index": index, "document": {"text": text}, "relevance_score": float(len(name))}
        for index, text in enumerate(body["documents"])
    ]
    return {"id": f"rerank-{name}", "model": body["model"], "results": results}


Answer = Callable[[str, dict[str, Any]], dict[str, Any]]
# What a replica answers on its endpoints other than the completions.
_ANSWERS: dict[str, Answer] = {
    "/v1/responses": _response,
    "/v1/messages": _message,
    "/v1/messages/count_tokens": _counted,
    **dict.fromkeys(("/v1/embeddings", "/pooling"), _embeddings),
    **dict.fromkeys(("/v1/score", "/score"), _scores),
    **dict.fromkeys(("/v1/rerank", "/rerank", "/v2/rerank"), _reranked),
}

# The events of a streamed answer on those endpoints that stream.
_STREAMED_EVENTS = {"/v1/responses": _response_events, "/v1/messages": _message_events}


def _chunks(name: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer as a replica sends it, the replica's name its one token: a chat answer's role first,
    the name, the end; the token ids when asked for (`return_token_ids`), and the usage."""
    token_ids = body.get("return_token_ids") is True
    if "messages" in body:
        head = {"id": f"chatcmpl-{name}", "object": "chat.completion.chunk"}
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        said = {"index": 0, "delta": {"content": name}, "logprobs": None}
        end = {"index": 0, "delta": {}, "logprobs": None}
        opening = [{"choices": [role], **({"prompt_token_ids": [1]} if token_ids else {})}]
    else:
        head = {"id": f"cmpl-{name}", "object": "text_completion"}
        said = {"index": 0, "text": name, "logprobs": None}
        end = {"index": 0, "text": "", "logprobs": None}
        opening = []
    if token_ids:
        said, end = {**said, "token_ids": [2]}, {**end, "token_ids": [3]}
    choices = [
        *opening,
        {"choices": [{**said, "finish_reason": None}]},
        {"choices": [{**end, "finish_reason": "stop", "stop_reason": None}]},
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        choices.append(
            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
        )
    created = int(time.time())
    return [{**head, "created": created, "model": body["model"], **chunk} for chunk in choices]


def as_streamed(body: dict[str, Any]) -> dict[str, Any]:
    """What a replica receives of a client's completion or chat completion: the gateway asks for a stream
    with each chunk's token ids (which it resumes a broken stream from), and the usage a non-streamed answer
    has."""
    streamed = {**body, "stream": True, "return_token_ids": True}
    if not body.get("stream"):
        streamed["stream_options"] = {"include_usage": True}
    return streamed


async def streamed_text(stream: Any) -> str:
    """The text of an SDK's chat stream, its chunks' content deltas joined."""
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


@asynccontextmanager
async def replicas(*specs: FakeReplica) -> AsyncIterator[list[FakeReplica]]:
    for replica in specs:
        await replica.start()
    try:
        yield list(specs)
    finally:
        for replica in specs:
            replica.resume.set()
            await replica.stop()


@asynccontextmanager
async def running_gateway(
    models: Mapping[str, ModelConfig], **options: Any
) -> AsyncIterator[tuple[Gateway, PublishedDiscovery, str]]:
    """A gateway serving `models` on a free loopback port: (gateway, its discovery, its base URL)."""
    discovery = PublishedDiscovery(models)
    gateway = Gateway(discovery, **options)
    runner = await gateway.start("127.0.0.1", 0)
    port = runner.addresses[0][1]
    try:
        await wait_until(lambda: set(gateway.fleet.pools) == set(models))
        yield gateway, discovery, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def leave_mid_stream(session: aiohttp.ClientSession, url: str, replica: FakeReplica) -> None:
    """A client that asks model m for a streamed chat, reads its first event and goes away; returns once
    `replica`, which serves it, saw the connection close."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    answer = await session.post(f"{url}/v1/chat/completions", json=body)
    assert (await answer.content.readuntil(b"\n\n")).startswith(b"data: ")
    answer.close()
    await asyncio.wait_for(replica.disconnected.wait(), WAIT_S)


async def wait_until(condition: Any) -> None:
    """Polls `condition` until true; fails the test (not a timed assertion) if it never becomes true."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never became true"
        await asyncio.sleep(0.01)


def queued(gateway: Gateway, model_name: str) -> float:
    """The requests the gateway holds for a model, as its /metrics page reports them."""
    value = gateway.metrics.registry.get_sample_value("kvfleet_gateway_queue_depth", {"model": model_name})
    return 0.0 if value is None else value


def model(
    name: str, *replicas: FakeReplica | str, prefill: tuple[FakeReplica | str, ...] = (), **settings: Any
) -> ModelConfig:
    """A model served by `replicas` (its decode replicas, when it has `prefill` replicas)."""
    return ModelConfig(name=name, endpoints=_urls(replicas), prefill_endpoints=_urls(prefill), **settings)


def _urls(replicas: tuple[FakeReplica | str, ...]) -> tuple[str, ...]:
    return tuple(replica if isinstance(replica, str) else replica.url for replica in replicas)


def service(name: str, namespace: str = "default", created: str | None = None, **spec: Any) -> dict[str, Any]:
    """An InferenceService; `created` is its creationTimestamp."""
    metadata = {"name": name, "namespace": namespace}
    if created is not None:
        metadata["creationTimestamp"] = created
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {"model": {"uri": "hf://org/model"}, **spec},
    }


def pod(
    service_name: str,
    ip: str | None,
    *,
    ready: bool = True,
    terminating: bool = False,
    port_name: str = "http",
    namespace: str = "default",
    port: int = 8000,
    role: str | None = None,
) -> dict[str, Any]:
    """A pod of the service's replicas (of a disaggregated service's `role`)."""
    labels = {"kvfleet.dev/inference-service": service_name}
    if role is not None:
        labels["kvfleet.dev/role"] = role
    metadata: dict[str, Any] = {"name": f"{service_name}-{ip}", "namespace": namespace, "labels": labels}
    if terminating:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "runtime", "ports": [{"name": port_name, "containerPort": port}]}]},
        "status": status,
    }


def replica_pod(
    service_name: str, replica: FakeReplica, namespace: str, role: str | None = None
) -> dict[str, Any]:
    """A ready pod of the service whose address is the fake replica's."""
    host, _, port = replica.url.removeprefix("http://").rpartition(":")
    return pod(service_name, host, namespace=namespace, port=int(port), role=role)
