"""`kvfleet run-batch`: vLLM's command and flags."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from kvfleet.runtime.batch.offline import INPUT_FORMATS
from kvfleet.runtime.config import (
    engine_config_from_options,
    engine_options,
    model_option,
    served_model_name_option,
)
from kvfleet.runtime.vllm_flags import VllmCommand


@click.command("run-batch", cls=VllmCommand)
@click.option(
    "-i",
    "--input-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Requests: OpenAI batch JSONL, or a CSV or Parquet table with a prompt or messages column.",
)
@click.option(
    "-o",
    "--output-file",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Answers: OpenAI batch output lines for JSONL, the table with output columns added otherwise. "
    "Rows it already holds are skipped, so a rerun resumes an interrupted run.",
)
@click.option(
    "--input-format",
    type=click.Choice(INPUT_FORMATS),
    default=None,
    help="Format of the input; by default its extension (.jsonl, .csv, .parquet) says.",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@model_option
@served_model_name_option
@engine_options
def run_batch(
    input_file: Path,
    output_file: Path,
    input_format: str | None,
    progress: bool,
    model: str,
    served_model_name: tuple[str, ...],
    **options: Any,
) -> None:
    """Answer a file of requests with the offline engine, without a server.

    Rows stream through the engine at full batch width; each answer is appended as it finishes. Exits 1
    if any row failed (its error is in the output), 2 for unusable input or options.
    """
    from kvfleet.runtime.batch.offline import run_batch as run

    if len(served_model_name) > 1:
        raise click.BadParameter("run-batch answers under one name", param_hint="--served-model-name")
    try:
        config = engine_config_from_options(model, options)
        summary = run(
            input_file,
            output_file,
            input_format=input_format,
            config=config,
            served_model_name=served_model_name[0] if served_model_name else model,
            progress=progress,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    rate = summary.answered / summary.seconds if summary.seconds else 0.0
    tokens = summary.output_tokens / summary.seconds if summary.seconds else 0.0
    click.echo(
        f"{summary.answered} rows answered, {summary.skipped} already in {output_file}, "
        f"{summary.failed} failed in all; {summary.output_tokens} output tokens in {summary.seconds:.1f} s "
        f"({rate:.2f} rows/s, {tokens:.1f} tokens/s)",
        err=True,
    )
    sys.exit(1 if summary.failed else 0)
