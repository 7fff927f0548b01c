"""`kvfleet bench serve`: load an OpenAI-compatible server over HTTP and measure what its clients feel.

Like vLLM's `bench serve`: seeded random token-id prompts and output lengths, Poisson arrivals at a given
rate (or all at once) optionally capped by a maximum concurrency, streamed completions timed per chunk.
Requests may carry SLA tiers (the x-kvfleet-priority header) drawn from a seeded mix, and results are
broken down per tier, so that the same workload run against a FCFS and a priority server compares them.
With --image-ratio, that share of the requests are chat requests with one image each (a seeded PNG of its own,
so that the encoder cache never answers) and a short question, for a vision model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

# The overload mix: a few urgent requests in a flood of background work.
OVERLOAD_MIX = "critical=0.1,standard=0.3,batch=0.6"


@dataclass
class BenchSettings:
    url: str
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 200
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.5
    output_range_ratio: float | None = None  # None: range_ratio
    tier_mix: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    vocab_size: int | None = None
    dataset_name: str = "random"
    tokenizer: str | None = None
    request_timeout: float = 600.0
    warmup: int = 2
    label: str = ""
    image_ratio: float = 0.0
    image_size: int = 336


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


@click.command("serve")
@click.option("--url", required=True, help="Base URL of the server, e.g. http://127.0.0.1:8000.")
@click.option("--model", default=None, help="Model name to request; the server's first by default.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None)
@click.option("--num-prompts", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--request-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=math.inf,
    show_default=True,
    help="Mean requests per second (Poisson arrivals); inf sends them all at once.",
)
@click.option(
    "--max-concurrency", type=click.IntRange(min=1), default=None, help="Cap on requests in flight."
)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--range-ratio",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.5,
    show_default=True,
    help="Lengths are uniform in [len * (1 - r), len * (1 + r)].",
)
@click.option(
    "--output-range-ratio",
    type=click.FloatRange(0, 1, max_open=True),
    default=None,
    help="The same for output lengths alone; --range-ratio by default.",
)
@click.option(
    "--tier-mix",
    default=None,
    help=f"SLA tier weights, e.g. critical=0.1,batch=0.9; `overload` = {OVERLOAD_MIX}.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--vocab-size", type=click.IntRange(min=17), default=None, help="If the server does not report it."
)
@click.option(
    "--dataset-name",
    type=click.Choice(["random", "corpus"]),
    default="random",
    show_default=True,
    help="random token ids, or passages of the corpus `kvfleet make-model` trains on (needs --tokenizer).",
)
@click.option(
    "--tokenizer", default=None, help="The served model's tokenizer folder, for --dataset-name corpus."
)
@click.option("--request-timeout", type=float, default=600.0, show_default=True)
@click.option(
    "--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Short untimed requests first."
)
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
@click.option("--label", default="", help="Name of this run in the report and the JSON.")
@click.option("--result-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_serve(result_json: Path | None, tier_mix: str | None, **options: object) -> None:
    """Benchmark a running OpenAI-compatible server (kvfleet or vLLM) with a seeded synthetic workload."""
    # One log line per request would drown the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Imported here so that listing the commands does not load an HTTP client.
    from kvfleet.runtime.bench.serve_client import run_benchmark
    from kvfleet.runtime.bench.serve_report import print_report, summarize

    settings = BenchSettings(tier_mix=parse_tier_mix(tier_mix), **options)  # type: ignore[arg-type]
    if settings.dataset_name == "corpus" and settings.tokenizer is None:
        raise click.BadParameter("--dataset-name corpus needs --tokenizer", param_hint="--tokenizer")
    results, duration = asyncio.run(run_benchmark(settings))
    summary = summarize(results, duration)
    print_report(settings.label, summary)
    if result_json is not None:
        settings_dict = asdict(settings)
        settings_dict["request_rate"] = str(settings.request_rate)
        result_json.write_text(json.dumps({"settings": settings_dict, **summary}, indent=2) + "\n")
