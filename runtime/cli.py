"""Runtime subcommands of `kvfleet`; heavy imports happen inside each command so `--help` stays instant."""

from __future__ import annotations

import click


@click.command("make-model")
@click.option(
    "--arch", type=click.Choice(["llama", "mistral", "qwen2", "qwen3"]), default="llama", show_default=True
)
@click.option("--preset", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True
)
@click.argument("out_dir", type=click.Path(file_okay=False))
def make_model(arch: str, preset: str, seed: int, dtype: str, out_dir: str) -> None:
    """Write a Hugging Face model folder with random weights and a trained tokenizer to OUT_DIR."""
    from kvfleet.runtime.models.make_model import make_model as build

    try:
        path = build(arch, preset, out_dir, seed=seed, dtype=dtype)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote {arch} ({preset}) to {path}")
