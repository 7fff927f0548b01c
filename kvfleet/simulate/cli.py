"""`kvfleet simulate`: replay a trace through a simulated fleet, generate traces, calibrate a profile."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import yaml

from kvfleet.simulate.engine import EngineProfile
from kvfleet.simulate.report import plot, write_json
from kvfleet.simulate.trace import TRACE_SHAPES, TraceShapeSpec, generate, read_trace, write_trace

if TYPE_CHECKING:
    from kvfleet.simulate.fleet import SimulationConfig


@click.group("simulate")
def simulate() -> None:
    """Simulate a fleet under a trace, with the operator's autoscaler and the gateway's routing."""


@simulate.command("run")
@click.option(
    "--service",
    "service_paths",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    multiple=True,
    help="An InferenceService manifest (or its spec alone): its scaling, routing, SLA and engine. Repeat it "
    "to compare services on the same trace.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, path_type=Path),
    help="CSV or JSON Lines: arrival_s, prompt_tokens, output_tokens, tier, prefix_group.",
)
@click.option(
    "--trace-spec",
    "trace_spec_path",
    type=click.Path(exists=True, path_type=Path),
    help="Instead of --trace: a generated trace, as YAML with `kvfleet simulate trace`'s settings (shape, "
    "duration_s, base_rate, peak_ratio, burst_start_s, burst_length_s, mean_prompt_tokens, "
    "mean_output_tokens, prefix_groups, seed); the cohort model draws it as cohorts, not request by request.",
)
@click.option(
    "--model",
    type=click.Choice(["request", "cohort"]),
    default="request",
    show_default=True,
    help="request: every request and engine step (exact, about 60 us of CPU a request); cohort: arrivals "
    "counted per span and engines as fluids, at a cost that does not grow with the requests (a day at 1,000 "
    "replicas in minutes), its attainment within a few points of the request model's on the traces measured "
    "(7 points over on a mix of tenants at 1,000 replicas running full) and its median latencies coarser "
    "(docs/benchmarks.md gives the error).",
)
@click.option(
    "--span-ms",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="cohort: the span whose arrivals make one cohort per tier and prefix group.",
)
@click.option(
    "--tick-ms",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="cohort: how long the engines advance at a time (a span must be whole ticks); longer is faster "
    "and coarser.",
)
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(exists=True, path_type=Path),
    help="The engine's step-time profile (JSON, from `kvfleet simulate calibrate`); a default one otherwise.",
)
@click.option(
    "--ttft-target-ms",
    type=click.IntRange(min=1),
    help="The TTFT that attainment counts against; default the spec's sla.ttftTargetMilliseconds.",
)
@click.option("--pod-start-seconds", type=click.FloatRange(min=0), default=60.0, show_default=True)
@click.option(
    "--shared-prefix-tokens",
    type=click.IntRange(min=0),
    default=256,
    show_default=True,
    help="Tokens the requests of one prefix group share.",
)
@click.option("--initial-replicas", type=click.IntRange(min=0))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The report (JSON): each service's, under its file's name.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A PNG of replicas and p90 TTFT over time.",
)
def run_command(
    service_paths: tuple[Path, ...],
    trace_path: Path | None,
    trace_spec_path: Path | None,
    model: str,
    span_ms: int,
    tick_ms: int,
    profile_path: Path | None,
    ttft_target_ms: int | None,
    pod_start_seconds: float,
    shared_prefix_tokens: int,
    initial_replicas: int | None,
    out: Path,
    plot_path: Path | None,
) -> None:
    """Replay a trace through a simulated fleet of each service and report how it did."""
    from kvfleet.operator.spec import SpecError
    from kvfleet.simulate.fleet import load_config

    if trace_path is not None and trace_spec_path is None:
        source: Path | TraceShapeSpec = trace_path
    elif trace_spec_path is not None and trace_path is None:
        source = _trace_shape(trace_spec_path)
    else:
        raise click.UsageError("give one of --trace and --trace-spec")
    profile = EngineProfile.load(profile_path) if profile_path else EngineProfile()
    summaries = {}
    for path in service_paths:
        try:
            config = load_config(
                _service_spec(path),
                profile,
                ttft_target_s=ttft_target_ms / 1000 if ttft_target_ms else None,
                pod_start_s=pod_start_seconds,
                shared_prefix_tokens=shared_prefix_tokens,
                initial_replicas=initial_replicas,
            )
        except (SpecError, ValueError) as error:
            raise click.UsageError(f"{path}: {error}") from None
        summary = summaries[path.stem] = _run(config, model, source, span_ms / 1000, tick_ms / 1000)
        figures = ("requests", "attainment", "ttft_p90_s", "replica_hours", "scale_events", "flaps", "shed")
        click.echo(f"{path.stem}: " + " ".join(f"{name}={summary[name]}" for name in figures))
        click.echo(f"{path.stem}: {summary['simulated_seconds_per_second']:.1f} simulated seconds per second")
    write_json(summaries, out)
    if plot_path is not None:
        plot(summaries, plot_path)


@simulate.command("trace")
@click.argument("shape", type=click.Choice(TRACE_SHAPES))
@click.option("--duration-seconds", type=click.FloatRange(min=0, min_open=True), required=True)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    required=True,
    help="Requests per second at the quietest level (steady: throughout).",
)
@click.option(
    "--peak-ratio",
    type=click.FloatRange(min=1),
    default=10.0,
    show_default=True,
    help="diurnal: the peak's rate over the quietest; burst: the burst's.",
)
@click.option("--burst-start-seconds", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--burst-seconds", type=click.FloatRange(min=0), default=60.0, show_default=True)
@click.option(
    "--prompt-tokens",
    type=click.FloatRange(min=1),
    default=512.0,
    show_default=True,
    help="The mean prompt length.",
)
@click.option(
    "--output-tokens",
    type=click.FloatRange(min=1),
    default=128.0,
    show_default=True,
    help="The mean output length.",
)
@click.option("--prefix-groups", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write it: .csv, or JSON Lines otherwise.",
)
def trace_command(
    shape: str,
    duration_seconds: float,
    rate: float,
    peak_ratio: float,
    burst_start_seconds: float,
    burst_seconds: float,
    prompt_tokens: float,
    output_tokens: float,
    prefix_groups: int,
    seed: int,
    out: Path,
) -> None:
    """Write a generated trace of SHAPE: steady, diurnal (one day's swing), burst or multi-tenant."""
    spec = TraceShapeSpec(
        shape=shape,  # type: ignore[arg-type]
        duration_s=duration_seconds,
        base_rate=rate,
        peak_ratio=peak_ratio,
        burst_start_s=burst_start_seconds,
        burst_length_s=burst_seconds,
        mean_prompt_tokens=prompt_tokens,
        mean_output_tokens=output_tokens,
        prefix_groups=prefix_groups,
        seed=seed,
    )
    click.echo(f"{write_trace(generate(spec), out)} requests written to {out}")


def _run(
    config: SimulationConfig, model: str, source: Path | TraceShapeSpec, span_s: float, tick_s: float
) -> dict[str, Any]:
    """One service's run on the trace (a file, or a generated trace's settings), by the model asked for."""
    if model == "request":
        from kvfleet.simulate.fleet import Simulation

        return Simulation(config).run(read_trace(source) if isinstance(source, Path) else generate(source))
    from kvfleet.simulate.cohorts import cohorts_of, generate_cohorts
    from kvfleet.simulate.fluid_fleet import CohortOptions, CohortSimulation

    try:
        simulation = CohortSimulation(config, CohortOptions(span_s=span_s, tick_s=tick_s))
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    if isinstance(source, Path):
        return simulation.run(cohorts_of(read_trace(source), span_s))
    return simulation.run(generate_cohorts(source, span_s))


def _trace_shape(path: Path) -> TraceShapeSpec:
    """A generated trace's settings, from YAML (TraceShapeSpec's fields)."""
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, dict):
        raise click.UsageError(f"{path} holds no trace settings")
    try:
        return TraceShapeSpec(**document)
    except TypeError as error:
        raise click.UsageError(f"{path}: {error}") from None


def _service_spec(path: Path) -> dict[str, Any]:
    """The spec of an InferenceService manifest, or the file itself when it is the spec alone."""
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, dict):
        raise click.UsageError(f"{path} holds no InferenceService")
    spec = document.get("spec") if "kind" in document else document
    if not isinstance(spec, dict):
        raise click.UsageError(f"{path} holds no InferenceService spec")
    return spec


@simulate.command("calibrate")
@click.option("--url", required=True, help="A replica's base URL, e.g. http://localhost:8000.")
@click.option(
    "--limits",
    "limits_path",
    type=click.Path(exists=True, path_type=Path),
    help="A profile whose max_num_seqs, token budget, KV cache and context cost to keep (decode batches "
    "are timed up to its max_num_seqs); the defaults otherwise.",
)
@click.option(
    "--served-model-name",
    "model",
    help="The model to time where the URL serves several (a fleet gateway, whose own time then counts as "
    "its clients see it); the first listed otherwise.",
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The profile (JSON)."
)
def calibrate_command(url: str, limits_path: Path | None, model: str | None, out: Path) -> None:
    """Time decode and prefill steps, and first tokens beside a decode batch and after idle pauses, on a real
    replica, and write the fitted engine profile (the pauses take 13 s of it)."""
    from kvfleet.simulate.calibrate import describe, fit_profile, measure

    limits = EngineProfile.load(limits_path) if limits_path else None
    timings = measure(url, limits.max_num_seqs if limits else None, model)
    for timing in timings:
        idle = f" after {timing.idle_s:g} s idle" if timing.idle_s else ""
        click.echo(
            f"{timing.kind:8s} prefill {timing.prefill_tokens:5d} tokens, "
            f"decode {timing.decode_sequences:3d} sequences{idle}: {timing.seconds * 1000:.2f} ms"
        )
    profile = fit_profile(timings, limits or EngineProfile())
    profile.dump(out)
    click.echo(f"{describe(profile)}; written to {out}")
