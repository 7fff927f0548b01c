"""`kvfleet bench serve`: load an OpenAI-compatible server over HTTP and measure what its clients feel.

It takes `vllm bench serve`'s flags with their meanings and writes its result file's keys, so that a command
line and the scripts reading its results work against either: datasets `random` (token ids, no tokenizer
needed) and `sharegpt` (a JSON file, read offline), arrivals at --request-rate with vLLM's --burstiness,
--max-concurrency, --goodput, --percentile-metrics / --metric-percentiles, --extra-body, --save-result. Never
a secret in the result file: neither the API key nor a header is written.

kvfleet's additions: requests may carry SLA tiers (the x-kvfleet-priority header) drawn from a seeded mix
and are then broken down per tier (`per_tier`), so that the same workload run against a FCFS and a priority
server compares them; --image-ratio makes that share of the requests chat requests with one image each (a
seeded PNG of its own, so that the encoder cache never answers) for a vision model; --dataset-name corpus
sends passages of the corpus `kvfleet make-model` trains on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from kvfleet.runtime.bench.serve_datasets import parse_range_ratio
from kvfleet.runtime.bench.serve_report import GOODPUT_METRICS, PERCENTILE_METRICS, MetricSelection
from kvfleet.runtime.list_options import ListOption, ListOptionsCommand

# The overload mix: a few urgent requests in a flood of background work.
OVERLOAD_MIX = "critical=0.1,standard=0.3,batch=0.6"
# The command's options about its result file rather than the run.
RESULT_FILE_OPTIONS = ("save_result", "save_detailed", "result_dir", "result_filename", "label", "metadata")
# vLLM's backends that send OpenAI completions (`vllm` is the same as `openai`) or chat completions.
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class BenchSettings:
    base_url: str
    endpoint: str = "/v1/completions"
    backend: str = "openai"
    model: str | None = None
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    num_prompts: int = 1000
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    dataset_name: str = "random"
    dataset_path: Path | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    # (input, output)
    random_range_ratio: tuple[float, float] = (0.0, 0.0)
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    tokenizer: str | None = None
    tier_mix: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    vocab_size: int | None = None
    request_timeout: float = 600.0
    num_warmups: int = 0
    ignore_eos: bool = False
    # None: the server's default, as vLLM sends none.
    temperature: float | None = None
    # Fields added to every request's body (vLLM's --extra-body).
    extra_body: dict[str, Any] = field(default_factory=dict)
    selection: MetricSelection = field(default_factory=MetricSelection)
    progress: bool = False
    image_ratio: float = 0.0
    image_size: int = 336


def synthetic_workload(input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    """The settings of the other benchmarks' served load: random prompts and outputs within half their mean
    lengths either way, greedy, after two warm-up requests."""
    return {
        "random_input_len": input_len,
        "random_output_len": output_len,
        "random_range_ratio": (0.5, 0.5),
        "temperature": 0.0,
        "num_warmups": 2,
        "seed": seed,
    }


def parse_tier_mix(text: str | None) -> dict[str, float]:
    """`critical=0.1,batch=0.9` (or `overload`) -> normalized weights."""
    if not text:
        return {}
    text = OVERLOAD_MIX if text == "overload" else text
    weights = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        try:
            weights[name.strip()] = float(weight)
        except ValueError:
            raise click.BadParameter(f"expected tier=weight, got {part!r}", param_hint="--tier-mix") from None
    total = sum(weights.values())
    if total <= 0 or any(w < 0 for w in weights.values()):
        raise click.BadParameter("weights must be non-negative and not all zero", param_hint="--tier-mix")
    return {name: weight / total for name, weight in weights.items()}


def parse_extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="--extra-body") from None
    if not isinstance(body, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--extra-body")
    return body


def parse_goodput(pairs: tuple[str, ...]) -> dict[str, float]:
    """`ttft:500 tpot:50` -> SLOs in milliseconds, by metric."""
    slos = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise click.BadParameter(
                f"expected METRIC:MILLISECONDS, got {pair!r}", param_hint="--goodput"
            ) from None
        if name not in GOODPUT_METRICS or slos[name] < 0:
            raise click.BadParameter(
                f"{pair!r}: the metric is one of {', '.join(GOODPUT_METRICS)} and the value non-negative",
                param_hint="--goodput",
            )
    return slos


def parse_key_values(items: tuple[str, ...], hint: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, has_value, value = item.partition("=")
        if not has_value:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=hint)
        pairs[key.strip()] = value.strip()
    return pairs


def metric_selection(
    metrics: str, percentiles: str, goodput: tuple[str, ...], max_concurrency: int | None, request_rate: float
) -> MetricSelection:
    """The metrics to report; the client queue's only under a concurrency cap (the last also at a finite
    rate), where vLLM measures them."""
    names = [name.strip() for name in metrics.split(",") if name.strip()]
    unknown = [name for name in names if name not in PERCENTILE_METRICS]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)}: not one of {', '.join(PERCENTILE_METRICS)}",
            param_hint="--percentile-metrics",
        )
    if max_concurrency is None:
        names = [n for n in names if n not in ("client_queue_time", "e2el_including_client_queue")]
    elif math.isinf(request_rate):
        names = [n for n in names if n != "e2el_including_client_queue"]
    try:
        values = tuple(float(p) for p in percentiles.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 <= p <= 100 for p in values):
        raise click.BadParameter(
            "expected percentiles in [0, 100], e.g. 50,90,99", param_hint="--metric-percentiles"
        )
    return MetricSelection(tuple(names), values, parse_goodput(goodput))


def resolve_base_url(base_url: str | None, host: str, port: int) -> str:
    if base_url is not None:
        return base_url.rstrip("/")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resolve_endpoint(backend: str, endpoint: str | None) -> str:
    if backend not in BACKENDS:
        raise click.BadParameter(
            f"{backend!r} is not supported: kvfleet sends OpenAI completions (openai, vllm) or chat "
            "completions (openai-chat)",
            param_hint="--backend",
        )
    endpoint = endpoint or BACKENDS[backend]
    if not endpoint.endswith("chat/completions" if backend == "openai-chat" else "completions"):
        raise click.BadParameter(
            f"{endpoint!r} is not a route of the {backend} backend", param_hint="--endpoint"
        )
    return endpoint


def result_file(
    label: str | None,
    backend: str,
    request_rate: float,
    max_concurrency: int | None,
    model_id: str,
    date: str,
    result_dir: Path | None,
    result_filename: str | None,
) -> Path:
    """vLLM's default name, `{label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json`, in
    result_dir."""
    concurrency = "" if max_concurrency is None else f"-concurrency{max_concurrency}"
    name = (
        result_filename
        or f"{label or backend}-{request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    )
    if result_dir is None:
        return Path(name)
    result_dir.mkdir(parents=True, exist_ok=True)
    return result_dir / name


def result_json(
    settings: BenchSettings,
    label: str | None,
    model_id: str,
    date: str,
    metadata: dict[str, str],
    results: dict[str, Any],
) -> dict[str, Any]:
    """vLLM's result file: the run's setup, then its results. No API key or header."""
    return {
        "date": date,
        "endpoint_type": settings.backend,
        "backend": settings.backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": settings.tokenizer or model_id,
        "num_prompts": settings.num_prompts,
        **metadata,
        "request_rate": settings.request_rate if math.isfinite(settings.request_rate) else "inf",
        "burstiness": settings.burstiness if math.isfinite(settings.burstiness) else "inf",
        "max_concurrency": settings.max_concurrency,
        **results,
    }


@click.command("serve", cls=ListOptionsCommand)
@click.option(
    "--backend", default="openai", show_default=True, help="openai / vllm (completions) or openai-chat."
)
@click.option("--base-url", default=None, help="The server's base URL; http://HOST:PORT by default.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--endpoint", default=None, help="Route; /v1/completions, or /v1/chat/completions for openai-chat."
)
@click.option("--header", cls=ListOption, metavar="KEY=VALUE", help="Headers sent with every request.")
@click.option("--model", default=None, help="Model name to request; the server's first by default.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="[env: OPENAI_API_KEY]")
@click.option(
    "--tokenizer",
    default=None,
    help="Tokenizer (folder or Hub id) for text datasets; the model's by default.",
)
@click.option(
    "--dataset-name",
    type=click.Choice(["random", "sharegpt", "corpus"]),
    default="random",
    show_default=True,
    help="random token ids; a ShareGPT JSON file (--dataset-path); or passages of the corpus `kvfleet "
    "make-model` trains on.",
)
@click.option("--dataset-path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--num-prompts", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--random-input-len", type=click.IntRange(min=0), default=1024, show_default=True)
@click.option("--random-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--random-range-ratio",
    default="0.0",
    show_default=True,
    help='Lengths uniform in [len * (1 - r), len * (1 + r)]; or {"input": r, "output": r}. Each r in [0, 1).',
)
@click.option(
    "--random-prefix-len",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Shared by every prompt.",
)
@click.option(
    "--sharegpt-output-len", type=click.IntRange(min=1), default=None, help="Instead of the answers' lengths."
)
@click.option("--input-len", type=click.IntRange(min=0), default=None, help="Sets --random-input-len.")
@click.option(
    "--output-len", type=click.IntRange(min=1), default=None, help="Sets every dataset's output length."
)
@click.option(
    "--request-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=math.inf,
    show_default=True,
    help="Mean requests per second; inf sends them all at once.",
)
@click.option(
    "--burstiness",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Shape of the gamma-distributed gaps between requests: 1 is a Poisson process, lower burstier, "
    "higher more even.",
)
@click.option(
    "--max-concurrency", type=click.IntRange(min=1), default=None, help="Cap on requests in flight."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--num-warmups", type=click.IntRange(min=0), default=0, show_default=True, help="Untimed requests first."
)
@click.option("--ignore-eos", is_flag=True, help="Always on for the random and corpus datasets.")
@click.option("--temperature", type=float, default=None, help="The server's default if not given.")
@click.option(
    "--extra-body",
    default=None,
    metavar="JSON",
    help="A JSON object of fields added to every request's body, e.g. '{\"stream_interval\": 8}'.",
)
@click.option(
    "--percentile-metrics",
    default="ttft,tpot,itl",
    show_default=True,
    help=f"Metrics to report statistics of, of {', '.join(PERCENTILE_METRICS)}.",
)
@click.option("--metric-percentiles", default="99", show_default=True, help="e.g. 50,90,99")
@click.option(
    "--goodput", cls=ListOption, metavar="METRIC:MS", help="SLOs of a good request: ttft, tpot, e2el."
)
@click.option("--disable-tqdm", is_flag=True, help="No progress bar.")
@click.option("--save-result", is_flag=True, help="Write the results as JSON.")
@click.option("--save-detailed", is_flag=True, help="With each request's lengths, times, text and error.")
@click.option("--result-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--result-filename", default=None, help="{label}-{rate}qps-{model}-{date}.json by default.")
@click.option("--metadata", cls=ListOption, metavar="KEY=VALUE", help="Written into the result file.")
@click.option("--label", default=None, help="Name of this run; the backend's in the file name by default.")
@click.option(
    "--tier-mix",
    default=None,
    help=f"SLA tier weights, e.g. critical=0.1,batch=0.9; `overload` = {OVERLOAD_MIX}.",
)
@click.option(
    "--vocab-size", type=click.IntRange(min=17), default=None, help="If the server does not report it."
)
@click.option("--request-timeout", type=float, default=600.0, show_default=True)
@click.option(
    "--image-ratio",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Share of requests that are chat requests with one image (a vision model's).",
)
@click.option(
    "--image-size", type=click.IntRange(min=1), default=336, show_default=True, help="Their images' side."
)
def bench_serve(**options: Any) -> None:
    """Benchmark a running OpenAI-compatible server (kvfleet or vLLM) as `vllm bench serve` does."""
    # One log line per request would drown the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Imported here so that listing the commands does not load an HTTP client.
    from kvfleet.runtime.bench.serve_client import run_benchmark
    from kvfleet.runtime.bench.serve_report import (
        failure_reasons,
        per_request_fields,
        print_report,
        summarize,
    )

    output = {key: options.pop(key) for key in RESULT_FILE_OPTIONS}
    label, metadata = output["label"], parse_key_values(output["metadata"], "--metadata")
    settings = settings_from_options(options)
    print(f"Traffic request rate: {settings.request_rate}")
    distribution = "Poisson process" if settings.burstiness == 1 else "Gamma distribution"
    print(f"Burstiness factor: {settings.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {settings.max_concurrency}")
    run = asyncio.run(run_benchmark(settings))
    summary = summarize(run.results, run.duration, settings.selection)
    traffic = [("Maximum request concurrency:", settings.max_concurrency)] if settings.max_concurrency else []
    if math.isfinite(settings.request_rate):
        traffic.append(("Request rate configured (RPS):", settings.request_rate))
    print_report(label or "", summary, settings.selection, failure_reasons(run.results), traffic)
    if not output["save_result"]:
        return
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    results = {**summary, **per_request_fields(run.results, output["save_detailed"])}
    path = result_file(
        label,
        settings.backend,
        settings.request_rate,
        settings.max_concurrency,
        run.model_id,
        date,
        output["result_dir"],
        output["result_filename"],
    )
    path.write_text(json.dumps(result_json(settings, label, run.model_id, date, metadata, results)) + "\n")


def settings_from_options(options: dict[str, Any]) -> BenchSettings:
    """The command's options as settings, checked together; vLLM's general --input-len / --output-len set
    each dataset's own."""
    input_len, output_len = options.pop("input_len"), options.pop("output_len")
    if input_len is not None:
        options["random_input_len"] = input_len
    if output_len is not None:
        options["random_output_len"] = options["sharegpt_output_len"] = output_len
    dataset, path = options["dataset_name"], options["dataset_path"]
    if dataset == "sharegpt" and path is None:
        raise click.BadParameter("--dataset-name sharegpt reads this file", param_hint="--dataset-path")
    if dataset != "sharegpt" and path is not None:
        raise click.BadParameter(f"the {dataset} dataset reads no file", param_hint="--dataset-path")
    selection = metric_selection(
        options.pop("percentile_metrics"),
        options.pop("metric_percentiles"),
        options.pop("goodput"),
        options["max_concurrency"],
        options["request_rate"],
    )
    base_url = resolve_base_url(options.pop("base_url"), options.pop("host"), options.pop("port"))
    return BenchSettings(
        base_url=base_url,
        endpoint=resolve_endpoint(options["backend"], options.pop("endpoint")),
        headers=parse_key_values(options.pop("header"), "--header"),
        extra_body=parse_extra_body(options.pop("extra_body")),
        random_range_ratio=parse_range_ratio(options.pop("random_range_ratio")),
        tier_mix=parse_tier_mix(options.pop("tier_mix")),
        selection=selection,
        progress=not options.pop("disable_tqdm"),
        **options,
    )
