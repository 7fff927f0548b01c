"""The load generator of `kvfleet bench serve`: builds the seeded workload, sends it, times every chunk."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import time
from dataclasses import dataclass

import click
import httpx
from kvfleet.contract.tiers import PRIORITY_HEADER
from kvfleet.runtime.bench.serve import BenchSettings
from kvfleet.runtime.bench.serve_report import RequestResult
from kvfleet.runtime.bench.workloads import corpus_requests, random_requests


@dataclass(frozen=True)
class ServeRequest:
    prompt_token_ids: list[int]
    output_len: int
    tier: str | None
    # Seconds after the start at which it is sent.
    send_at: float
    # A chat request with a fixed question and this image (a data URL, made before the run so that encoding
    # it never delays another request's timing); None: a completion of prompt_token_ids.
    image_url: str | None = None


def build_workload(settings: BenchSettings, vocab_size: int) -> list[ServeRequest]:
    """Lengths uniform within range_ratio of the means; arrivals a Poisson process; all from the seed."""
    output_spread = (
        settings.range_ratio if settings.output_range_ratio is None else settings.output_range_ratio
    )

    def bounds(mean: int, spread: float) -> tuple[int, int]:
        return max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))

    prompt_lens = bounds(settings.input_len, settings.range_ratio)
    output_lens = bounds(settings.output_len, output_spread)
    if settings.dataset_name == "corpus":
        assert settings.tokenizer is not None
        corpus = corpus_token_ids(settings.tokenizer)
        base = corpus_requests(settings.num_prompts, prompt_lens, output_lens, corpus, seed=settings.seed)
    else:
        base = random_requests(settings.num_prompts, prompt_lens, output_lens, vocab_size, seed=settings.seed)
    rng = random.Random(settings.seed + 1)
    tiers = list(settings.tier_mix)
    weights = [settings.tier_mix[t] for t in tiers]
    requests, clock = [], 0.0
    for index, item in enumerate(base):
        tier = rng.choices(tiers, weights)[0] if tiers else None
        image_url = None
        if rng.random() < settings.image_ratio:
            image_url = _image_url(settings.seed * 1_000_003 + index, settings.image_size)
        requests.append(ServeRequest(item.prompt_token_ids, item.output_len, tier, clock, image_url))
        if math.isfinite(settings.request_rate):
            clock += rng.expovariate(settings.request_rate)
    return requests


def corpus_token_ids(tokenizer: str) -> list[int]:
    from kvfleet.runtime.models.make_model import corpus_text
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer).encode(corpus_text(), add_special_tokens=False)


def _image_url(seed: int, size: int) -> str:
    """A PNG of seeded noise, as a data URL."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _body(model: str, request: ServeRequest) -> tuple[str, dict]:
    """(route, body) of a request."""
    body = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.image_url is None:
        return "/v1/completions", {**body, "prompt": request.prompt_token_ids}
    content = [
        {"type": "text", "text": "What does this picture show?"},
        {"type": "image_url", "image_url": {"url": request.image_url}},
    ]
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": content}]}


def _chunk_text(chunk: dict) -> bool:
    """Whether a streamed chunk of either route carries text."""
    return any(
        choice.get("text") or (choice.get("delta") or {}).get("content") for choice in chunk["choices"]
    )


async def send_request(client: httpx.AsyncClient, model: str, request: ServeRequest) -> RequestResult:
    """Streams one request and times its chunks; a failure is the result's error, never an exception."""
    route, body = _body(model, request)
    headers = {PRIORITY_HEADER: request.tier} if request.tier else {}
    result = RequestResult(tier=request.tier or "-", prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", route, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = _error_code(response)
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("code") or chunk["error"].get("type") or "error"
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    # The server's count: an image's placeholders are part of its prompt.
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
        return result
    result.latency = time.perf_counter() - start
    return result


def _error_code(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return str(error.get("code") or error.get("type") or response.status_code)
    except (ValueError, KeyError, TypeError):
        return str(response.status_code)


async def _server_model(client: httpx.AsyncClient, settings: BenchSettings) -> tuple[str, int]:
    response = await client.get("/v1/models")
    response.raise_for_status()
    cards = response.json()["data"]
    card = cards[0] if settings.model is None else next((c for c in cards if c["id"] == settings.model), None)
    if card is None:
        served = ", ".join(c["id"] for c in cards)
        raise click.UsageError(f"the server does not serve {settings.model!r}; it serves {served}")
    vocab_size = settings.vocab_size or card.get("vocab_size")
    if not vocab_size:
        raise click.UsageError("the server does not report its vocab_size; pass --vocab-size")
    return card["id"], int(vocab_size)


async def run_benchmark(settings: BenchSettings) -> tuple[list[RequestResult], float]:
    """Returns each request's result (in workload order) and the wall time of the whole run."""
    connections = settings.max_concurrency or settings.num_prompts
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    async with bench_client(settings.url, connections, settings.request_timeout, headers) as client:
        model, vocab_size = await _server_model(client, settings)
        workload = build_workload(settings, vocab_size)
        # Prompts of their own: reusing the workload's would hand it prefix-cache hits.
        warmup = random_requests(settings.warmup, (16, 16), (4, 4), vocab_size, seed=settings.seed + 2)
        for request in warmup:
            await send_request(
                client, model, ServeRequest(request.prompt_token_ids, request.output_len, None, 0.0)
            )
        return await send_workload(client, model, workload, settings.max_concurrency)


def bench_client(
    url: str, connections: int, timeout: float, headers: dict[str, str] | None = None
) -> httpx.AsyncClient:
    """A client with a connection for each request that may be in flight."""
    return httpx.AsyncClient(
        base_url=url.rstrip("/"),
        headers=headers,
        timeout=timeout,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def send_workload(
    client: httpx.AsyncClient, model: str, workload: list[ServeRequest], max_concurrency: int | None = None
) -> tuple[list[RequestResult], float]:
    """Sends each request at its time (at most max_concurrency in flight); each result in workload order, and
    the wall time from the first send to the last answer."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(request: ServeRequest) -> RequestResult:
        if limit is None:
            return await send_request(client, model, request)
        async with limit:
            return await send_request(client, model, request)

    start = time.perf_counter()
    tasks = []
    for request in workload:
        delay = start + request.send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start
