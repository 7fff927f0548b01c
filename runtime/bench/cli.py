"""`kvfleet bench`: the benchmark commands. Heavy imports happen inside each command, so `--help` stays
instant."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click
from kvfleet.runtime.bench.safety import POLICY_KEYS as SAFETY_POLICY_KEYS
from kvfleet.runtime.bench.serve import bench_serve
from kvfleet.runtime.config import engine_config_from_options, engine_options

# The options the benchmark commands share.
small_model_option = click.option(
    "--model", type=click.Path(exists=True, file_okay=False), default=None, help="Default: make `small`."
)
bench_seed_option = click.option(
    "--bench-seed", type=int, default=0, show_default=True, help="Seed of the synthetic workload."
)


@click.group()
def bench() -> None:
    """Benchmarks (their results go in docs/benchmarks.md)."""


bench.add_command(bench_serve)


@bench.command("static-server", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench_static_server(context: click.Context) -> None:
    """`kvfleet serve` with static batching, the baseline continuous batching is measured against.

    Takes every option of `kvfleet serve`."""
    from kvfleet.runtime.bench.static_batching import StaticBatchingEngineCore
    from kvfleet.runtime.server.cli import serve

    serve.main(context.args, prog_name="kvfleet bench static-server", obj=StaticBatchingEngineCore)


@bench.command("throughput")
@small_model_option
@click.option("--num-requests", type=int, default=128, show_default=True)
@click.option("--batch-sizes", default="1,16,64", show_default=True, help="Transformers static batch sizes.")
@bench_seed_option
@engine_options
def bench_throughput(
    model: str | None, num_requests: int, batch_sizes: str, bench_seed: int, **options
) -> None:
    """Offline throughput of kvfleet against Transformers `generate` with static batches, same workload."""
    from kvfleet.runtime.bench.report import print_throughput_report
    from kvfleet.runtime.bench.throughput import run_all

    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        report = run_all(
            model_dir,
            num_requests=num_requests,
            batch_sizes=[int(b) for b in batch_sizes.split(",")],
            engine_options=config.as_options(),
            seed=bench_seed,
            log=lambda line: click.echo(line, err=True),
        )
    print_throughput_report(report)


@bench.command("structured")
@small_model_option
@click.option("--num-requests", type=int, default=64, show_default=True)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Alternating constrained and unconstrained runs; each mode's fastest counts.",
)
@bench_seed_option
@engine_options
def bench_structured(model: str | None, num_requests: int, rounds: int, bench_seed: int, **options) -> None:
    """Throughput under JSON-schema constraints against the same requests unconstrained, and compile times."""
    from kvfleet.runtime.bench.report import print_structured_report
    from kvfleet.runtime.bench.structured import run_structured

    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        report = run_structured(
            model_dir,
            num_requests=num_requests,
            rounds=rounds,
            engine_options=config.as_options(),
            seed=bench_seed,
            log=lambda line: click.echo(line, err=True),
        )
    print_structured_report(report)


@bench.command("safety")
@small_model_option
@click.option("--num-prompts", type=click.IntRange(min=2), default=40, show_default=True, help="For TTFT.")
@click.option("--throughput-prompts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--window-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--policy",
    "selected",
    multiple=True,
    type=click.Choice(SAFETY_POLICY_KEYS),
    help="Measure only these policies (repeatable; the baseline `none` always runs). Default: all.",
)
@bench_seed_option
@engine_options
def bench_safety(
    model: str | None,
    num_prompts: int,
    throughput_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    window_tokens: int,
    selected: tuple[str, ...],
    bench_seed: int,
    **options,
) -> None:
    """TTFT added by each safety checker on input, and throughput with output checking on against off."""
    import logging

    from kvfleet.runtime.bench.safety import format_report, run_safety_bench
    from kvfleet.runtime.bench.serve import BenchSettings, synthetic_workload

    logging.getLogger("httpx").setLevel(logging.WARNING)
    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        workload = synthetic_workload(input_len, output_len, bench_seed)
        report = run_safety_bench(
            config,
            ttft=BenchSettings(base_url="", num_prompts=num_prompts, **workload),
            throughput=BenchSettings(base_url="", num_prompts=throughput_prompts, **workload),
            concurrency=concurrency,
            window=window_tokens,
            selected=selected or SAFETY_POLICY_KEYS,
            log=lambda line: click.echo(line, err=True),
        )
    click.echo(format_report(report))


@bench.command("batch")
@small_model_option
@click.option("--num-rows", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--concurrency",
    default="16,64,256",
    show_default=True,
    help="Client concurrencies the same rows are sent to `kvfleet serve` with; the best one is compared.",
)
@click.option(
    "--interactive-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Requests per second of the interactive load whose TTFT is measured.",
)
@click.option("--interactive-prompts", type=click.IntRange(min=2), default=30, show_default=True)
@bench_seed_option
@engine_options
def bench_batch(
    model: str | None,
    num_rows: int,
    input_len: int,
    output_len: int,
    concurrency: str,
    interactive_rate: float,
    interactive_prompts: int,
    bench_seed: int,
    **options,
) -> None:
    """`kvfleet run-batch` against the same rows through `kvfleet serve`, and interactive TTFT with and
    without a Batch API batch beside it (serve with --scheduling-policy priority to see the batch tier)."""
    import logging

    from kvfleet.runtime.bench.batch import format_report, run_batch_bench
    from kvfleet.runtime.bench.serve import BenchSettings, synthetic_workload
    from kvfleet.runtime.models.model_config import ModelConfig

    # One log line per request would drown the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        settings = BenchSettings(
            base_url="", num_prompts=num_rows, **synthetic_workload(input_len, output_len, bench_seed)
        )
        interactive = BenchSettings(
            base_url="",
            num_prompts=interactive_prompts,
            request_rate=interactive_rate,
            **synthetic_workload(input_len, output_len, bench_seed + 100),
        )
        report = run_batch_bench(
            config,
            settings=settings,
            concurrencies=[int(c) for c in concurrency.split(",")],
            interactive=interactive,
            vocab_size=ModelConfig.from_folder(model_dir).vocab_size,
            log=lambda line: click.echo(line, err=True),
        )
    click.echo(format_report(report))


@bench.command("lora")
@small_model_option
@click.option("--num-requests", type=int, default=64, show_default=True)
@click.option("--num-adapters", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=16, show_default=True)
@bench_seed_option
@engine_options
def bench_lora(
    model: str | None, num_requests: int, num_adapters: int, rank: int, bench_seed: int, **options
) -> None:
    """Throughput of requests spread over LoRA adapters against the same requests on the base model."""
    from kvfleet.runtime.bench.lora import run_lora
    from kvfleet.runtime.bench.report import print_lora_report

    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        results = run_lora(
            model_dir,
            num_requests=num_requests,
            num_adapters=num_adapters,
            rank=rank,
            engine_options=config.as_options(),
            seed=bench_seed,
            log=lambda line: click.echo(line, err=True),
        )
    print_lora_report(*results)


@bench.command("multi-turn")
@small_model_option
@click.option("--num-users", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--num-turns", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--system-prompt-len", type=click.IntRange(min=0), default=64, show_default=True)
@click.option("--user-message-len", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--answer-len", type=click.IntRange(min=1), default=32, show_default=True)
@bench_seed_option
@engine_options
def bench_multi_turn(
    model: str | None,
    num_users: int,
    num_turns: int,
    system_prompt_len: int,
    user_message_len: int,
    answer_len: int,
    bench_seed: int,
    **options,
) -> None:
    """Chats whose every request carries the whole history: prefill computed and TTFT by turn, with
    prefix caching on and off."""
    from kvfleet.runtime.bench.multi_turn import MultiTurnSettings, run_multi_turn
    from kvfleet.runtime.bench.report import print_multi_turn_report

    settings = MultiTurnSettings(
        num_users=num_users,
        num_turns=num_turns,
        system_prompt_len=system_prompt_len,
        user_message_len=user_message_len,
        answer_len=answer_len,
        seed=bench_seed,
    )
    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        report = run_multi_turn(
            model_dir,
            settings,
            engine_options=config.as_options(),
            log=lambda line: click.echo(line, err=True),
        )
    print_multi_turn_report(report)


@bench.command("long-context")
@click.option(
    "--model",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Default: make a tiny Llama whose max_position_embeddings reach the longest context.",
)
@click.option(
    "--context-lens",
    default="16384,32768,65536,131072",
    show_default=True,
    help="Prompt + output tokens of each run, comma-separated.",
)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--parity-len",
    type=click.IntRange(min=0),
    default=32768,
    show_default=True,
    help="The context length whose greedy tokens are checked against Transformers (0: none).",
)
@bench_seed_option
@engine_options
def bench_long_context(
    model: str | None, context_lens: str, output_len: int, parity_len: int, bench_seed: int, **options
) -> None:
    """One long prompt per context length through chunked prefill: time, peak RSS, and tokens against
    Transformers at one length. Each length runs in a process of its own with a KV pool of its size."""
    from kvfleet.runtime.bench.long_context import LongContextSettings, format_report, run_long_context
    from kvfleet.runtime.bench.report import machine_line
    from kvfleet.runtime.models.make_model import make_model

    lens = tuple(int(n) for n in context_lens.split(","))
    settings = LongContextSettings(lens, output_len, parity_len or None, bench_seed)
    with contextlib.ExitStack() as stack:
        if model is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "model"
            model = str(make_model("llama", "tiny", folder, max_position_embeddings=max(lens)))
        config = engine_config_from_options(model, options)
        runs = run_long_context(
            Path(model), settings, config.as_options(), log=lambda line: click.echo(line, err=True)
        )
    click.echo(format_report(runs, machine_line()))


@bench.command("engine-timing")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--plan",
    "plan_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the plan, which vLLM's side (bench/vllm/engine_timing.py) then runs too.",
)
@click.option("--result-json", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--cpu-kv-cache-space",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="GiB of KV cache, whole (vLLM's VLLM_CPU_KVCACHE_SPACE takes no fraction).",
)
@click.option("--num-requests", type=click.IntRange(min=8), default=64, show_default=True)
@bench_seed_option
def bench_engine_timing(
    model: str,
    plan_path: Path,
    result_json: Path,
    max_num_seqs: int,
    cpu_kv_cache_space: int,
    num_requests: int,
    bench_seed: int,
) -> None:
    """kvfleet's offline throughput and decode step time (batch 1 and 8) on a plan vLLM can run too."""
    from kvfleet.runtime.bench.engine_timing import make_plan, run_kvfleet, write_json
    from kvfleet.runtime.models.model_config import ModelConfig

    plan = make_plan(
        str(Path(model).resolve()),
        vocab_size=ModelConfig.from_folder(model).vocab_size,
        max_num_seqs=max_num_seqs,
        cpu_kv_cache_space=cpu_kv_cache_space,
        num_requests=num_requests,
        seed=bench_seed,
    )
    write_json(plan_path, plan)
    result = run_kvfleet(plan)
    write_json(result_json, result)
    click.echo(
        f"kvfleet: offline {result['offline']['tokens_per_second']:.1f} output tokens/s; decode step "
        + ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in result["decode_step_ms"].items())
    )


@bench.command("step-phases")
@small_model_option
@click.option("--batch-sizes", default="1,8", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--quantize",
    type=click.Choice(["w8a16", "w4a16", "fp8"]),
    default=None,
    help="Also measure a copy of the model with its projections quantized so (`make-model --quantize`), "
    "batch size by batch size beside the float model.",
)
@click.option(
    "--quantize-lm-head",
    is_flag=True,
    help="With --quantize, also measure a third copy with its LM head quantized too "
    "(`make-model --quantize-lm-head`).",
)
@engine_options
def bench_step_phases(
    model: str | None,
    batch_sizes: str,
    steps: int,
    rounds: int,
    quantize: str | None,
    quantize_lm_head: bool,
    **options,
) -> None:
    """Where a decode step's time goes, phase by phase, at each batch size."""
    import torch
    from kvfleet.runtime import LLM
    from kvfleet.runtime.bench.step_phases import format_table, measure_step_phases

    if quantize_lm_head and quantize is None:
        raise click.UsageError("--quantize-lm-head needs --quantize")
    with contextlib.ExitStack() as stack:
        model_dir = stack.enter_context(_model_or_small(model))
        folders = {"": model_dir}
        if quantize is not None:
            folders[quantize] = stack.enter_context(_quantized_copy(model_dir, quantize))
        if quantize_lm_head:
            label = f"{quantize}, LM head too"
            folders[label] = stack.enter_context(_quantized_copy(model_dir, quantize, lm_head=True))
        engines = {
            label: LLM(folder, **engine_config_from_options(folder, options).as_options())
            for label, folder in folders.items()
        }
        # Each batch size measured on every model in turn, so that all see the machine's load alike.
        results = [
            measure_step_phases(llm, int(batch), steps=steps, rounds=rounds, label=label)
            for batch in batch_sizes.split(",")
            for label, llm in engines.items()
        ]
    click.echo(f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}\n")
    click.echo(format_table(results))
    per_batch = len(engines)
    for offset, label in enumerate(list(engines)[1:], start=1):
        pairs = zip(results[::per_batch], results[offset::per_batch], strict=True)
        speedups = ", ".join(f"batch {f.batch_size} {f.step_ms / q.step_ms:.2f}x" for f, q in pairs)
        click.echo(f"\n{label} against the float model, whole step: {speedups}")


@bench.command("disaggregated")
@small_model_option
@click.option("--seconds", type=click.FloatRange(min=1), default=60.0, show_default=True)
@click.option("--chat-rate", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True)
@click.option(
    "--long-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=0.5,
    show_default=True,
    help="Mean long prompts (1-2K tokens) per second.",
)
@click.option(
    "--cpus",
    default="0,1",
    show_default=True,
    help="The colocated replica's CPUs (an even number); the prefill role takes the first half, the decode "
    "role the rest.",
)
@click.option(
    "--threshold-tokens",
    type=click.IntRange(min=0),
    default=256,
    show_default=True,
    help="The gateway's --pd-threshold-tokens: shorter prompts skip the prefill replica.",
)
@click.option("--result-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
@bench_seed_option
@engine_options
def bench_disaggregated(
    model: str | None,
    seconds: float,
    chat_rate: float,
    long_rate: float,
    cpus: str,
    threshold_tokens: int,
    result_json: Path | None,
    bench_seed: int,
    **options,
) -> None:
    """Streaming chats among long prompts: one colocated replica against a prefill and a decode replica behind
    the gateway, on the same CPUs."""
    from kvfleet.runtime.bench.disaggregated import MixSettings, format_report, run_disaggregated_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = MixSettings(seconds=seconds, chat_rate=chat_rate, long_rate=long_rate, seed=bench_seed)
    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        report = run_disaggregated_bench(
            config,
            settings,
            cpus=_even_cpus(cpus),
            threshold_tokens=threshold_tokens,
            vocab_size=vocab_size,
            log=lambda line: click.echo(line, err=True),
        )
    if result_json is not None:
        result_json.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(format_report(report))


@bench.command("routing")
@small_model_option
@click.option("--replicas", type=click.IntRange(min=2), default=3, show_default=True)
@click.option(
    "--policies",
    default="precise-prefix,cache-aware,prefix-hash,round-robin",
    show_default=True,
    help="The gateway's routing policies to compare, each on a fresh fleet.",
)
@click.option("--tenants", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--rate", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True, help="Requests/s."
)
@click.option(
    "--zipf",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="Exponent of the tenants' Zipf popularity (0: uniform).",
)
@click.option(
    "--load-bound",
    type=click.FloatRange(min=1.0),
    default=2.0,
    show_default=True,
    help="The gateways' --load-bound.",
)
@click.option("--result-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
@bench_seed_option
@engine_options
def bench_routing(
    model: str | None,
    replicas: int,
    policies: str,
    tenants: int,
    requests: int,
    rate: float,
    zipf: float,
    load_bound: float,
    result_json: Path | None,
    bench_seed: int,
    **options,
) -> None:
    """Routing policies side by side: tenants with long prefixes, two gateways sharing the traffic, caches too
    small for every prefix (without --num-gpu-blocks-override, 160 blocks a replica; without
    --kv-offloading-size, a host tier of 0.03 GiB), and the hit rate an oracle of every replica's cache
    finds."""
    from kvfleet.contract.routing import POLICY_NAMES
    from kvfleet.runtime.bench.routing import TenantSettings, format_routing_report, run_routing_bench

    chosen = [policy.strip() for policy in policies.split(",")]
    unknown = [policy for policy in chosen if policy not in POLICY_NAMES]
    if unknown:
        raise click.BadParameter(f"unknown policies {unknown}; choose among {list(POLICY_NAMES)}")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if options.get("num_gpu_blocks_override") is None:
        options["num_gpu_blocks_override"] = 160
    if options.get("kv_offloading_size") is None:
        options["kv_offloading_size"] = 0.03
    settings = TenantSettings(tenants=tenants, requests=requests, rate=rate, zipf=zipf, seed=bench_seed)
    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        report = run_routing_bench(
            config,
            settings,
            replicas=replicas,
            policies=chosen,
            load_bound=load_bound,
            vocab_size=vocab_size,
            log=lambda line: click.echo(line, err=True),
        )
    if result_json is not None:
        result_json.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(format_routing_report(report))


@bench.command("resume")
@small_model_option
@click.option("--replicas", type=click.IntRange(min=2), default=3, show_default=True)
@click.option("--streams", type=click.IntRange(min=1), default=24, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--output-len", type=click.IntRange(min=2), default=256, show_default=True)
@click.option(
    "--stop-at",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.5,
    show_default=True,
    help="Share of all the streams' tokens received when a replica is stopped.",
)
@click.option(
    "--stop",
    type=click.Choice(["kill", "term"]),
    default="kill",
    show_default=True,
    help="kill: SIGKILL, a crash; term: SIGTERM with no drain time, a hand-back.",
)
@click.option(
    "--rounds", type=click.IntRange(min=1), default=1, show_default=True, help="Each a fresh fleet."
)
@click.option("--result-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
@bench_seed_option
@engine_options
def bench_resume(
    model: str | None,
    replicas: int,
    streams: int,
    prompt_len: int,
    output_len: int,
    stop_at: float,
    stop: str,
    rounds: int,
    result_json: Path | None,
    bench_seed: int,
    **options,
) -> None:
    """A replica stopped under long streams behind the gateway, which resumes them elsewhere: resume latency
    (the gateway's histogram and the clients' view), tokens replayed, and whether every stream completed."""
    from kvfleet.runtime.bench.resume import ResumeSettings, format_resume_report, run_resume_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = ResumeSettings(
        replicas=replicas,
        streams=streams,
        prompt_len=prompt_len,
        output_len=output_len,
        stop_at=stop_at,
        stop=stop,  # type: ignore[arg-type]  (click checked the choice)
        rounds=rounds,
        seed=bench_seed,
    )
    with _model_or_small(model) as model_dir:
        config = engine_config_from_options(model_dir, options)
        vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        report = run_resume_bench(
            config, settings, vocab_size=vocab_size, log=lambda line: click.echo(line, err=True)
        )
    if result_json is not None:
        result_json.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(format_resume_report(report))


@bench.command("startup")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Model folder.")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Starts of each kind.")
@click.option(
    "--kind",
    "kinds",
    type=click.Choice(["cold", "prebuilt", "warm"]),
    multiple=True,
    default=("cold", "prebuilt", "warm"),
    show_default=True,
    help="cold: empty kernel caches; prebuilt: empty caches and the CPU operations prebuilt, as the runtime "
    "image holds them; warm: caches a first start filled, as a node's shared cache. Repeatable.",
)
@engine_options
def bench_startup(model: str, runs: int, kinds: tuple[str, ...], **options) -> None:
    """Start `kvfleet serve` on MODEL again and again: each phase of the start, the time to Ready and the
    time to first token, counted from the launch."""
    from kvfleet.runtime.bench.startup import format_startup_report, run_startup_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = engine_config_from_options(model, options)
    results = run_startup_bench(config, kinds, runs, log=lambda line: click.echo(line, err=True))
    click.echo(format_startup_report(results))


@bench.command("vs-vllm-report")
@click.option("--results", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--doc", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--commit", required=True, help="The commit the figures were measured at.")
def bench_vs_vllm_report(results: Path, doc: Path, commit: str) -> None:
    """Write the table of a `make bench-vs-vllm` run into DOC, replacing the previous one."""
    from kvfleet.runtime.bench.vs_vllm_report import build_section, replace_section

    section = build_section(results, commit)
    replace_section(doc, section)
    click.echo(section)


def _even_cpus(text: str) -> list[int]:
    try:
        cpus = [int(part) for part in text.split(",")]
    except ValueError:
        cpus = []
    if not cpus or len(cpus) % 2 or len(set(cpus)) != len(cpus):
        message = f"expected an even number of distinct CPU numbers separated by commas, got {text!r}"
        raise click.BadParameter(message, param_hint="--cpus")
    return cpus


@contextlib.contextmanager
def _quantized_copy(model_dir: str, scheme: str, *, lm_head: bool = False) -> Iterator[str]:
    """A copy of a float model folder with its projections quantized (its LM head too with `lm_head`),
    removed afterwards."""
    import shutil

    from kvfleet.runtime.models.make_model.quantize import quantize_folder

    with tempfile.TemporaryDirectory(prefix=f"kvfleet-{scheme}-") as parent:
        folder = Path(parent) / Path(model_dir).name
        shutil.copytree(model_dir, folder)
        quantize_folder(folder, scheme, lm_head=lm_head)
        yield str(folder)


@contextlib.contextmanager
def _model_or_small(model: str | None) -> Iterator[str]:
    """The given folder, or the `small` benchmark model, made once into the cache and reused."""
    if model is not None:
        yield model
        return
    from kvfleet.runtime.models.make_model import make_model as build

    cache = Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))
    folder = cache / "models" / "llama-small-seed0"
    if not (folder / "config.json").exists():
        click.echo(f"making the small benchmark model in {folder}", err=True)
        build("llama", "small", str(folder), seed=0, dtype="float32")
    yield str(folder)
