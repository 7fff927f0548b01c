"""End-to-end section of the GPU benchmark: output tokens/s of kvfleet and of Transformers `generate` on
the same weights, every request in flight at once.

Each measurement runs in its own process (`python engine_bench.py kvfleet|transformers MODEL ...`, one
JSON line on stdout), so one engine's memory is gone before the next loads and a crash costs one row.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from checkout import use_this_checkout

use_this_checkout()

# The 8B-shaped model: Llama-3-8B's layer shapes and vocabulary, random weights.
LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "dtype": "bfloat16",
}
# Tokens of each request whose greedy choices are compared between the two implementations.
COMPARED_TOKENS = 4


def make_small_model(out: Path) -> Path:
    from kvfleet.runtime.models.make_model import make_model

    return make_model("llama", "small", out, seed=0, dtype="bfloat16")


def make_random_llama(out: Path, shape: dict[str, Any], device: torch.device) -> Path:
    """The small preset's tokenizer and configuration files, reshaped by `shape`, with random bfloat16
    weights (drawn on `device`: the 8B shape takes minutes on a CPU)."""
    from safetensors.torch import save_file

    make_small_model(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(shape)
    config_path.write_text(json.dumps(config, indent=2))
    (out / "model.safetensors").unlink()
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    generator = torch.Generator(device=device).manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        weights = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(
            0.0, 0.02, generator=generator
        )
        return weights.cpu()

    tensors = {
        "model.embed_tokens.weight": random(config["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": random(config["vocab_size"], hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": random(q_size, hidden),
            prefix + "self_attn.k_proj.weight": random(kv_size, hidden),
            prefix + "self_attn.v_proj.weight": random(kv_size, hidden),
            prefix + "self_attn.o_proj.weight": random(hidden, q_size),
            prefix + "mlp.gate_proj.weight": random(inter, hidden),
            prefix + "mlp.up_proj.weight": random(inter, hidden),
            prefix + "mlp.down_proj.weight": random(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def workload(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]


def run_kvfleet(args: argparse.Namespace) -> dict[str, Any]:
    from kvfleet.runtime import LLM, SamplingParams

    options: dict[str, Any] = {
        "dtype": "bfloat16",
        "device": args.device,
        "max_model_len": args.prompt_len + args.output_len + 16,
    }
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    start = time.perf_counter()
    llm = LLM(args.model, **options)
    load_seconds = time.perf_counter() - start
    vocab = llm.get_tokenizer().vocab_size
    # Warm-up on other prompts: compiles kernels without seeding the prefix cache with the workload.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(workload(8, args.prompt_len, vocab, seed=1), warm, use_tqdm=False)
    prompts = workload(args.requests, args.prompt_len, vocab, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    synchronize(args.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    synchronize(args.device)
    seconds = time.perf_counter() - start
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    runner = getattr(llm.llm_engine, "runner", None)
    backend = getattr(getattr(runner, "attention_backend", None), "name", "unknown")
    return {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in tokens),
        "load_seconds": load_seconds,
        "attention_backend": backend,
        "first_tokens": [t[:COMPARED_TOKENS] for t in tokens],
    }


def run_transformers(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    load_seconds = time.perf_counter() - start
    vocab = AutoTokenizer.from_pretrained(args.model).vocab_size
    pad_id = 0

    def generate(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        input_ids = torch.tensor(prompts, device=args.device)
        with torch.inference_mode():
            return model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )

    generate(workload(8, args.prompt_len, vocab, seed=1), 4)
    prompts = workload(args.requests, args.prompt_len, vocab, seed=0)
    synchronize(args.device)
    start = time.perf_counter()
    output = generate(prompts, args.output_len)
    synchronize(args.device)
    seconds = time.perf_counter() - start
    new = output[:, args.prompt_len :]
    return {
        "seconds": seconds,
        "output_tokens": new.numel(),
        "load_seconds": load_seconds,
        "first_tokens": new[:, :COMPARED_TOKENS].tolist(),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("engine", choices=["kvfleet", "transformers", "make-small", "make-8b"])
    parser.add_argument("model", help="model folder (written by the make-* commands)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="worker processes, one GPU each")
    parser.add_argument("--device", default="cuda", help="cpu only to check this script on toy sizes")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.engine == "make-small":
        make_small_model(Path(args.model))
        result: dict[str, Any] = {}
    elif args.engine == "make-8b":
        make_random_llama(Path(args.model), LLAMA_8B, torch.device(args.device))
        result = {}
    elif args.engine == "kvfleet":
        result = run_kvfleet(args)
    else:
        result = run_transformers(args)
    result["wall_seconds"] = time.perf_counter() - start
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
