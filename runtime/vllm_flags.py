"""vLLM's flags that kvfleet does not take, refused with the reason instead of click's "No such option": a
vLLM command line moved onto kvfleet then says what to do about each."""

from __future__ import annotations

import click
from kvfleet.runtime.list_options import ListOptionsCommand

_ONE_ENGINE = (
    "a kvfleet replica is one engine: run more replicas instead (an InferenceService's scaling, or more "
    "`kvfleet serve` processes behind `kvfleet gateway`)"
)
_EAGER = "the model runs eagerly, without torch.compile or CUDA graphs"
_HTTP_ONLY = "kvfleet serves its API over HTTP, OpenAI's and vLLM's routes"
_NO_PLUGINS = "kvfleet loads no classes from elsewhere: its scheduler, workers and parsers are its own"
_FIXED_EXPERTS = (
    "experts stay where they were placed at load: each rank holds its share (--enable-expert-parallel)"
)

NOT_TAKEN: dict[str, str] = {
    "--async-scheduling": "kvfleet's engine core schedules each step once the previous step's outputs are in",
    "--data-parallel-size": _ONE_ENGINE,
    "--data-parallel-size-local": _ONE_ENGINE,
    "--data-parallel-rank": _ONE_ENGINE,
    "--data-parallel-address": _ONE_ENGINE,
    "--data-parallel-rpc-port": _ONE_ENGINE,
    "--data-parallel-backend": _ONE_ENGINE,
    "--data-parallel-start-rank": _ONE_ENGINE,
    "--data-parallel-hybrid-lb": _ONE_ENGINE,
    "--data-parallel-external-lb": _ONE_ENGINE,
    "--compilation-config": _EAGER,
    "--optimization-level": _EAGER,
    "-O": _EAGER,
    "--cudagraph-capture-sizes": _EAGER,
    "--max-cudagraph-capture-size": _EAGER,
    "--swap-space": "a preempted request's KV waits in the host tier that --kv-offloading-size (GiB) sets",
    "--cpu-offload-gb": "the weights stay on the device",
    "--guided-decoding-backend": "vLLM's older flag: --structured-outputs-config takes the backend",
    "--skip-tokenizer-init": "the server tokenizes prompts and detokenizes answers itself",
    "--disable-sliding-window": "a model with a sliding window attends within it",
    "--logits-processors": (
        "custom logits processors are not loaded; vLLM's built-in ones (min_p, min_tokens, logit_bias, "
        "bad_words, ...) are request fields"
    ),
    "--enable-eplb": _FIXED_EXPERTS,
    "--eplb-config": _FIXED_EXPERTS,
    "--numa-bind": "kvfleet sizes its CPU threads to the cores it may use; bind the process with its cpuset",
    "--max-parallel-loading-workers": "each rank reads only the slices of the checkpoint it holds",
    "--mm-processor-kwargs": "images and audio are preprocessed as the model folder's processor config says",
    "--mm-processor-cache-gb": "kvfleet caches encoder outputs (by content), not preprocessed inputs",
    "--kv-offloading-backend": "the host-memory KV tier is kvfleet's own: --kv-offloading-size (GiB) sets it",
    "--prefix-caching-hash-algo": (
        "blocks are named by kvfleet's SHA-256 chain over their tokens (kvfleet.contract.block_hash), which "
        "its KV events carry"
    ),
    "--lora-dtype": "adapters run in the model's dtype: their weights are cast to it as they load",
    "--fully-sharded-loras": "adapters are not sharded: --enable-lora needs --tensor-parallel-size 1",
    "--ignore-patterns": "kvfleet reads a model's safetensors weights, config and tokenizer files, no others",
    "--code-revision": "no code from the model's repository runs: kvfleet has each architecture's own",
    "--grpc": _HTTP_ONLY,
    "--grpc-port": _HTTP_ONLY,
    "--headless": "a node other than the first (--node-rank above 0) runs its ranks and serves no API",
    "--enable-mm-embeds": "images come as data:, http(s) or file: URLs and audio as base64, not embeddings",
    "--scheduler-cls": _NO_PLUGINS,
    "--worker-cls": _NO_PLUGINS,
    "--worker-extension-cls": _NO_PLUGINS,
    "--tool-parser-plugin": f"{_NO_PLUGINS}; --tool-call-parser names a built-in one",
    "--reasoning-parser-plugin": f"{_NO_PLUGINS}; --reasoning-parser names a built-in one",
}


class VllmCommand(ListOptionsCommand):
    """A command that takes vLLM's command lines: list flags in vLLM's form, and vLLM's flags it lacks
    refused with the reason."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as error:
            reason = NOT_TAKEN.get(error.option_name)
            if reason is None:
                raise
            raise click.UsageError(
                f"{error.option_name} is vLLM's and not kvfleet's: {reason}", ctx
            ) from None
