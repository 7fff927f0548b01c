"""Runtime subcommands of `kvfleet`; heavy imports happen inside each command so `--help` stays instant."""

from __future__ import annotations

import json

import click
from kvfleet.runtime.config import engine_config_from_options, engine_options


@click.command("make-model")
@click.option(
    "--arch",
    type=click.Choice(
        ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3-moe", "llava", "qwen2-audio", "qwen2.5-omni"]
    ),
    default="llama",
    show_default=True,
)
@click.option(
    "--preset", type=click.Choice(["tiny", "small", "small-draft"]), default="tiny", show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True
)
@click.option(
    "--train-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Then train the weights this many steps on the tokenizer's corpus (on the CPU; about 1 s a step for "
    "the small preset), so that outputs are predictable and draft models agree with their targets.",
)
@click.option(
    "--teacher",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="With --train-steps: learn this model folder's next-token distributions on the corpus instead of "
    "the corpus's next tokens (knowledge distillation, how a draft model is fitted to its target).",
)
@click.option(
    "--max-position-embeddings", type=click.IntRange(min=1), default=None, help="Default: the preset's."
)
@click.option(
    "--rope-parameters",
    default=None,
    help='rope_parameters of config.json as JSON, e.g. \'{"rope_type": "linear", "factor": 4}\'',
)
@click.option("--sliding-window", type=click.IntRange(min=1), default=None, help="Mistral and Qwen only.")
@click.option(
    "--max-window-layers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Qwen: the layers from this one on slide.",
)
@click.option(
    "--quantize",
    type=click.Choice(["w8a16", "w4a16", "fp8"]),
    default=None,
    help="Write the projections quantized in the compressed-tensors format (llm-compressor's scheme names): "
    "int8 per channel, int4 in groups, or float8 per channel; activations stay in float.",
)
@click.option(
    "--quantize-lm-head",
    is_flag=True,
    help="Quantize the LM head with the projections (llm-compressor's recipes leave it in float).",
)
@click.argument("out_dir", type=click.Path(file_okay=False))
def make_model(
    arch: str,
    preset: str,
    seed: int,
    dtype: str,
    train_steps: int,
    teacher: str | None,
    max_position_embeddings: int | None,
    rope_parameters: str | None,
    sliding_window: int | None,
    max_window_layers: int,
    quantize: str | None,
    quantize_lm_head: bool,
    out_dir: str,
) -> None:
    """Write a Hugging Face model folder with random weights and a trained tokenizer to OUT_DIR."""
    from kvfleet.runtime.models.make_model import make_model as build

    try:
        rope = None if rope_parameters is None else json.loads(rope_parameters)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--rope-parameters") from exc
    if rope is not None and not isinstance(rope, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--rope-parameters")
    try:
        path = build(
            arch,
            preset,
            out_dir,
            seed=seed,
            dtype=dtype,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=rope,
            sliding_window=sliding_window,
            max_window_layers=max_window_layers,
            train_steps=train_steps,
            teacher=teacher,
            quantize=quantize,
            quantize_lm_head=quantize_lm_head,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote {arch} ({preset}) to {path}")


@click.command("make-adapter")
@click.option(
    "--base", required=True, type=click.Path(exists=True, file_okay=False), help="Base model folder."
)
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--alpha", type=float, default=None, help="lora_alpha; by default the rank (scaling 1).")
@click.option(
    "--target-modules",
    default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    show_default=True,
    help="Comma-separated projections to adapt.",
)
@click.option("--use-rslora", is_flag=True, help="Scale by alpha / sqrt(rank) instead of alpha / rank.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.argument("out_dir", type=click.Path(file_okay=False))
def make_adapter(
    base: str, rank: int, alpha: float | None, target_modules: str, use_rslora: bool, seed: int, out_dir: str
) -> None:
    """Write a PEFT LoRA adapter with random weights for the model at --base to OUT_DIR."""
    from kvfleet.runtime.lora.make_adapter import make_adapter as build

    targets = tuple(t.strip() for t in target_modules.split(",") if t.strip())
    try:
        path = build(
            base, out_dir, rank=rank, alpha=alpha, target_modules=targets, use_rslora=use_rslora, seed=seed
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote a rank-{rank} adapter to {path}")


@click.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Model folder.")
@click.option("--prompt", "prompts", multiple=True, required=True, help="A prompt; repeat for several.")
@click.option("--chat", is_flag=True, help="Send each prompt as a user message through the chat template.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@engine_options
def generate(
    model: str,
    prompts: tuple[str, ...],
    chat: bool,
    max_tokens: int,
    temperature: float,
    top_p: float,
    **options,
) -> None:
    """Run the engine offline on a few prompts and print what it generates."""
    from kvfleet.runtime import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        llm = LLM(model, **engine_config_from_options(model, options).as_options())
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(list(prompts), params)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        click.echo(f"{prompt!r} -> {completion.text!r} ({completion.finish_reason})")


@click.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the demo model is written; a temporary folder by default.",
)
def demo(workdir: str | None) -> None:
    """Make a tiny model, run the engine on a few prompts, print the outputs and throughput."""
    from kvfleet.runtime.demo import run_demo

    run_demo(workdir)


@click.command("download-model")
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch, tag or commit; the default branch if omitted.")
@click.option("--dest", required=True, type=click.Path(file_okay=False), help="Folder to write the model to.")
def download_model(repo_id: str, revision: str | None, dest: str) -> None:
    """Fetch a model from the Hugging Face Hub into DEST (the init container of `hf://` models).

    Honours HF_TOKEN, HF_HOME and HF_ENDPOINT; an already complete DEST is left as it is.
    """
    from kvfleet.runtime.hub import HubError, HubRepository, download

    if "/" not in repo_id or repo_id.startswith("/"):
        raise click.UsageError(f"{repo_id!r} is not a repository id of the form org/name")
    try:
        path = download(HubRepository(repo_id, revision), dest, must_contain="config.json")
    except HubError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"downloaded {repo_id} to {path}")


@click.command("build-kernels")
@click.argument("folder", type=click.Path(file_okay=False))
def build_kernels(folder: str) -> None:
    """Build the C++ CPU operations into FOLDER for every CPU level a node may have (the runtime image's
    build step); a runtime with KVFLEET_PREBUILT_KERNELS=FOLDER loads them instead of compiling."""
    from pathlib import Path

    from kvfleet.runtime.kernels.cpu_build import prebuild_cpu_ops
    from kvfleet.runtime.kernels.cpu_features import prebuild_targets

    for path in prebuild_cpu_ops(Path(folder), prebuild_targets()):
        click.echo(f"built {path}")
