"""The load generator of `kvfleet bench serve`: builds the seeded workload, sends it, times every chunk."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import click
import httpx
from kvfleet.contract.tiers import PRIORITY_HEADER
from kvfleet.runtime.bench.serve import BenchSettings
from kvfleet.runtime.bench.serve_datasets import (
    DatasetPrompt,
    corpus_prompts,
    random_prompts,
    sharegpt_prompts,
)
from kvfleet.runtime.bench.serve_report import RequestResult
from kvfleet.runtime.bench.workloads import random_requests
from tqdm import tqdm

CHAT_ROUTE = "/v1/chat/completions"


@dataclass(frozen=True)
class ServeRequest:
    prompt_token_ids: list[int]
    output_len: int
    tier: str | None
    # Seconds after the start at which it is sent.
    send_at: float
    # A chat request with a fixed question and this image (a data URL, made before the run so that encoding
    # it never delays another request's timing); None: a request of the prompt alone.
    image_url: str | None = None
    # The prompt as text, sent instead of its token ids (a text dataset, or a chat backend).
    text: str | None = None


@dataclass(frozen=True)
class RequestOptions:
    """How a request is sent: to which route, and with which sampling fields."""

    endpoint: str = "/v1/completions"
    chat: bool = False
    ignore_eos: bool = True
    # None: the server's default.
    temperature: float | None = 0.0
    # Fields added to every body, over the benchmark's own.
    extra_body: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class BenchRun:
    results: list[RequestResult]
    duration: float
    model_id: str


def arrival_times(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent, as vLLM draws them: gaps from a gamma
    distribution of shape `burstiness` and mean 1 / rate (1: a Poisson process; lower: burstier; inf: evenly
    spaced), then stretched so that the last request leaves at count / rate whatever the draws."""
    if math.isinf(request_rate):
        return [0.0] * count
    if math.isinf(burstiness):
        gaps = [1 / request_rate] * count
    else:
        rng = random.Random(seed)
        gaps = [rng.gammavariate(burstiness, 1 / (request_rate * burstiness)) for _ in range(count)]
    times = list(itertools.accumulate(gaps))
    stretch = count / request_rate / times[-1]
    return [t * stretch for t in times]


def dataset_prompts(settings: BenchSettings, vocab_size: int | None, tokenizer: Any) -> list[DatasetPrompt]:
    lengths = (settings.random_input_len, settings.random_output_len, settings.random_range_ratio)
    if settings.dataset_name == "sharegpt":
        assert settings.dataset_path is not None
        return sharegpt_prompts(
            settings.dataset_path,
            settings.num_prompts,
            tokenizer,
            settings.sharegpt_output_len,
            settings.seed,
        )
    if settings.dataset_name == "corpus":
        return corpus_prompts(settings.num_prompts, *lengths, tokenizer, seed=settings.seed)
    assert vocab_size is not None
    return random_prompts(
        settings.num_prompts, *lengths, settings.random_prefix_len, vocab_size, settings.seed
    )


def build_workload(
    settings: BenchSettings, vocab_size: int | None, tokenizer: Any = None
) -> list[ServeRequest]:
    """The dataset's prompts with their send times, SLA tiers and images, all from the seed. A chat backend
    is sent text: token-id prompts are decoded with the tokenizer."""
    prompts = dataset_prompts(settings, vocab_size, tokenizer)
    send_at = arrival_times(len(prompts), settings.request_rate, settings.burstiness, settings.seed + 2)
    rng = random.Random(settings.seed + 1)
    tiers = list(settings.tier_mix)
    weights = [settings.tier_mix[t] for t in tiers]
    requests = []
    for index, (prompt, at) in enumerate(zip(prompts, send_at, strict=True)):
        tier = rng.choices(tiers, weights)[0] if tiers else None
        image_url = None
        if rng.random() < settings.image_ratio:
            image_url = _image_url(settings.seed * 1_000_003 + index, settings.image_size)
        text = prompt.text
        if text is None and settings.backend == "openai-chat":
            text = tokenizer.decode(prompt.prompt_token_ids)
        requests.append(ServeRequest(prompt.prompt_token_ids, prompt.output_len, tier, at, image_url, text))
    return requests


def _image_url(seed: int, size: int) -> str:
    """A PNG of seeded noise, as a data URL."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _body(model: str, request: ServeRequest, options: RequestOptions) -> tuple[str, dict]:
    """(route, body) of a request."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.ignore_eos:
        body["ignore_eos"] = True
    body |= options.extra_body
    if request.image_url is None and not options.chat:
        prompt = request.prompt_token_ids if request.text is None else request.text
        return options.endpoint, {**body, "prompt": prompt, "max_tokens": request.output_len}
    if request.image_url is None:
        content: str | list[dict] = request.text or ""
    else:
        content = [
            {"type": "text", "text": "What does this picture show?"},
            {"type": "image_url", "image_url": {"url": request.image_url}},
        ]
    route = options.endpoint if options.chat else CHAT_ROUTE
    messages = [{"role": "user", "content": content}]
    return route, {**body, "messages": messages, "max_completion_tokens": request.output_len}


def _chunk_text(chunk: dict) -> str:
    """The text a streamed chunk of either route carries."""
    return "".join(
        choice.get("text") or (choice.get("delta") or {}).get("content") or "" for choice in chunk["choices"]
    )


async def send_request(
    client: httpx.AsyncClient, model: str, request: ServeRequest, options: RequestOptions = RequestOptions()
) -> RequestResult:
    """Streams one request and times its chunks; a failure is the result's error, never an exception."""
    route, body = _body(model, request, options)
    headers = {PRIORITY_HEADER: request.tier} if request.tier else {}
    result = RequestResult(tier=request.tier or "-", prompt_len=len(request.prompt_token_ids))
    start = last = result.start_time = time.perf_counter()
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
                if text := _chunk_text(chunk):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += text
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


async def _server_model(client: httpx.AsyncClient, settings: BenchSettings) -> tuple[str, int | None]:
    """The model to request and, for random token ids, its vocabulary size."""
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise click.ClickException(f"no model list from {client.base_url}/v1/models: {exc}") from None
    cards = response.json()["data"]
    card = cards[0] if settings.model is None else next((c for c in cards if c["id"] == settings.model), None)
    if card is None:
        served = ", ".join(c["id"] for c in cards)
        raise click.UsageError(f"the server does not serve {settings.model!r}; it serves {served}")
    vocab_size = settings.vocab_size or card.get("vocab_size")
    if settings.dataset_name == "random" and not vocab_size:
        raise click.UsageError("the server does not report its vocab_size; pass --vocab-size")
    return card["id"], vocab_size and int(vocab_size)


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"cannot load the tokenizer {name!r} ({exc}); pass --tokenizer") from None


def needs_tokenizer(settings: BenchSettings) -> bool:
    return settings.dataset_name in ("sharegpt", "corpus") or settings.backend == "openai-chat"


def request_options(settings: BenchSettings) -> RequestOptions:
    return RequestOptions(
        endpoint=settings.endpoint,
        chat=settings.backend == "openai-chat",
        # vLLM always ignores EOS on its synthetic datasets, so that outputs run to their drawn lengths.
        ignore_eos=settings.ignore_eos or settings.dataset_name in ("random", "corpus"),
        temperature=settings.temperature,
        extra_body=settings.extra_body,
    )


async def run_benchmark(settings: BenchSettings) -> BenchRun:
    """Each request's result (in workload order), the wall time of the whole run, and the model asked."""
    connections = settings.max_concurrency or settings.num_prompts
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    headers |= settings.headers
    async with bench_client(settings.base_url, connections, settings.request_timeout, headers) as client:
        model, vocab_size = await _server_model(client, settings)
        tokenizer = load_tokenizer(settings.tokenizer or model) if needs_tokenizer(settings) else None
        workload = build_workload(settings, vocab_size, tokenizer)
        options = request_options(settings)
        # Prompts of their own: reusing the workload's would hand it prefix-cache hits.
        warmup_vocab = vocab_size or tokenizer.vocab_size
        warmup = random_requests(settings.num_warmups, (16, 16), (4, 4), warmup_vocab, seed=settings.seed + 4)
        for request in warmup:
            text = tokenizer.decode(request.prompt_token_ids) if options.chat else None
            await send_request(
                client, model, ServeRequest(request.prompt_token_ids, 4, None, 0.0, text=text), options
            )
        results, duration = await send_workload(
            client, model, workload, settings.max_concurrency, options, settings.progress
        )
        return BenchRun(results, duration, model)


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
    client: httpx.AsyncClient,
    model: str,
    workload: list[ServeRequest],
    max_concurrency: int | None = None,
    options: RequestOptions = RequestOptions(),
    progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Sends each request at its time (at most max_concurrency in flight); each result in workload order, and
    the wall time from the first send to the last answer. Start times are made relative to the run's start."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(workload), disable=not progress)

    async def one(request: ServeRequest) -> RequestResult:
        due = time.perf_counter()
        if limit is None:
            result = await send_request(client, model, request, options)
        else:
            async with limit:
                result = await send_request(client, model, request, options)
        result.queue_time = result.start_time - due
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for request in workload:
        delay = start + request.send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    for result in results:
        result.start_time -= start
    return results, duration
