"""kvfleet's greedy outputs against Hugging Face Transformers on the same folder (float32, CPU; and bf16 and
fp16 in the same dtype on both sides).

The criterion is vLLM's own for model tests: tokens equal, or at the first difference each side's token is
in the other's top-5 (two near-tied logits may legitimately swap under a different summation order), after
which the sequences are no longer comparable.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.kernels import cpu_features
from transformers import AutoModel, AutoModelForCausalLM

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MAX_TOKENS = 12
TOP_N = 5


def _prompts(vocab_size: int) -> list[list[int]]:
    """16 prompts of mixed lengths; half share a 40-token prefix so prefix caching has something to hit."""
    rng = random.Random(1234)
    shared = [rng.randrange(16, vocab_size) for _ in range(40)]
    prompts = []
    for i in range(16):
        own = [rng.randrange(16, vocab_size) for _ in range(rng.choice([1, 3, 9, 17, 30, 55]))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def _reference(
    model_dir: Path, prompts: list[list[int]], **config: Any
) -> list[tuple[list[int], list[set[int]]]]:
    """Greedy tokens and the top-5 at each step, one prompt at a time (no padding in the reference), each on
    a fresh model (with `config` over its config.json): `dynamic` RoPE keeps the longest length it has seen
    across generate() calls, which would make a prompt's reference depend on the prompts before it."""
    results = []
    for prompt in prompts:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config).eval()
        results.append(greedy_reference(model, input_ids=torch.tensor([prompt])))
    return results


def greedy_reference(model: Any, **inputs: Any) -> tuple[list[int], list[set[int]]]:
    """A Transformers model's MAX_TOKENS greedy tokens after one prompt, and its top-5 at each step."""
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [set(step[0].topk(TOP_N).indices.tolist()) for step in out.logits]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request: pytest.FixtureRequest, make_model: Callable[..., Path]):
    model_dir = make_model(request.param, "tiny")
    prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return model_dir, prompts, _reference(model_dir, prompts)


def _assert_close(outputs, reference) -> None:
    assert len(outputs) == len(reference)
    for i, (output, (ref_tokens, ref_tops)) in enumerate(zip(outputs, reference, strict=True)):
        logprobs = output.outputs[0].logprobs
        our_tops = [set(sorted(step, key=step.get, reverse=True)[:TOP_N]) for step in logprobs]
        _assert_sequence_close(f"prompt {i}", output.outputs[0].token_ids, our_tops, ref_tokens, ref_tops)


def _assert_sequence_close(
    name: str, tokens: list[int], our_tops: list[set[int]], ref_tokens: list[int], ref_tops: list[set[int]]
) -> None:
    """Equal tokens, or at the first difference each side's token in the other's top-5."""
    assert len(tokens) == MAX_TOKENS, f"{name}: {len(tokens)} tokens"
    for step, (ours, theirs) in enumerate(zip(tokens, ref_tokens, strict=True)):
        if ours == theirs:
            continue
        assert ours in ref_tops[step] and theirs in our_tops[step], (
            f"{name} step {step}: kvfleet {ours} vs transformers {theirs}; "
            f"top-5 kvfleet {our_tops[step]}, transformers {ref_tops[step]}"
        )
        break


ENGINE_VARIANTS = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    # Prompts cut by the step's budget, and, while others are present, by vLLM's long-prefill threshold.
    "chunked-prefill": dict(
        max_num_batched_tokens=24, long_prefill_token_threshold=10, enable_prefix_caching=True
    ),
    # 16 requests of up to ~110 tokens need far more than 14 blocks of 8: forces preemption by recompute.
    "preemption": dict(
        num_gpu_blocks_override=14, block_size=8, max_model_len=112, max_num_batched_tokens=64
    ),
    # The same, with preempted requests' KV saved in a host-memory tier and copied back on resume.
    "preemption-host-tier": dict(
        num_gpu_blocks_override=14,
        block_size=8,
        max_model_len=112,
        max_num_batched_tokens=64,
        kv_offloading_size=0.01,
    ),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(arch_case, variant: str) -> None:
    model_dir, prompts, reference = arch_case
    options = {"num_gpu_blocks_override": 256, "max_model_len": 256, **ENGINE_VARIANTS[variant]}
    llm = LLM(str(model_dir), dtype="float32", **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    outputs = llm.generate(prompts, params)
    _assert_close(outputs, reference)
    stats = llm.llm_engine.stats
    if variant.startswith("preemption"):
        assert stats.num_preempted_total > 0, "the pool was meant to be too small for the batch"
    if variant == "preemption-host-tier":
        assert stats.kv_offload_resumed_from_host > 0
    if variant == "prefix-caching":
        assert stats.prefix_cache_hits > 0
    if variant == "no-prefix-caching":
        assert stats.prefix_cache_hits == 0


def test_pooled_prompts_match_transformers(arch_case) -> None:
    """A prompt's final hidden states pooled as vLLM pools them: the last token's, the first's and their mean,
    with chunked prefill and prefix-cache hits (half the prompts share a prefix; each prompt is asked twice,
    so the second meets it whole in the cache, which the first and mean poolings compute past), the three
    poolings in one batch."""
    model_dir, prompts, _ = arch_case
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=256,
        max_num_batched_tokens=24,
    )
    requests = [(prompt, pooling) for pooling in ("LAST", "MEAN", "CLS") for prompt in prompts + prompts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1, prompt_pooling=pooling) for _, pooling in requests
    ]
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for (prompt, pooling), output in zip(requests, outputs, strict=True):
            states = model(torch.tensor([prompt])).last_hidden_state[0]
            expected = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling]
            torch.testing.assert_close(
                torch.tensor(output.prompt_hidden_state), expected, atol=1e-4, rtol=1e-4
            )
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[0].prompt_hidden_state is None


def assert_prompt_logprobs_match(
    prompt: list[int],
    prompt_logprobs: list[Any] | None,
    logits: torch.Tensor,
    top: int,
    as_logits: bool = False,
) -> None:
    """kvfleet's prompt logprobs against the log-softmax of Transformers' logits over the prompt ([len,
    vocab]), or the logits themselves: each token's score and rank, and the likeliest `top` in its place (by
    value: two near-tied tokens may swap under a different summation order)."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    expected = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
    for position, (token, scores) in enumerate(zip(prompt[1:], prompt_logprobs[1:], strict=True)):
        reference = expected[position]
        assert scores.logprobs[token] == pytest.approx(reference[token].item(), abs=1e-4)
        # A rank counts the tokens scored above: those within the tolerance may fall either side.
        above, near = reference > reference[token] + 1e-4, (reference - reference[token]).abs() <= 1e-4
        assert int(above.sum()) + 1 <= scores.rank <= int(above.sum() + near.sum()), (position, scores.rank)
        likeliest = sorted(scores.logprobs.values(), reverse=True)[:top]
        np.testing.assert_allclose(likeliest, reference.topk(top).values.tolist(), atol=1e-4)
        assert len(scores.logprobs) in (top, top + 1)


def test_prompt_logprobs_match_transformers(arch_case) -> None:
    """Every prompt token scored, with chunked prefill and prefix caching on: each prompt is asked twice, and
    a request for its prompt's logprobs takes no hit (it computes every token's logits)."""
    model_dir, prompts, _ = arch_case
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=256,
        max_num_batched_tokens=24,
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2)
    outputs = llm.generate(prompts + prompts, params)
    assert llm.llm_engine.stats.prefix_cache_hits == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt, output in zip(prompts + prompts, outputs, strict=True):
            logits = model(torch.tensor([prompt])).logits[0]
            assert_prompt_logprobs_match(prompt, output.prompt_logprobs, logits, 3)
    # The blocks they computed serve the requests that do not ask.
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    assert all(output.prompt_logprobs is None for output in plain)


def test_raw_logits_mode_scores_prompt_and_answer_by_the_models_logits(
    make_model: Callable[..., Path],
) -> None:
    """vLLM's logprobs_mode="raw_logits": a prompt's and an answer's tokens are scored by Transformers' logits
    themselves, not their log-softmax."""
    model_dir = make_model("llama", "tiny")
    prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])[:3]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_model_len=256,
        logprobs_mode="raw_logits",
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        (completion,) = output.outputs
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
        assert_prompt_logprobs_match(prompt, output.prompt_logprobs, logits[: len(prompt)], 2, as_logits=True)
        for position, (token, scores) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            reference = logits[len(prompt) - 1 + position]
            assert max(reference) > 0  # logits, which no logprob can be
            assert scores[token] == pytest.approx(reference[token].item(), abs=1e-4)
            likeliest = sorted(scores.values(), reverse=True)[:2]
            np.testing.assert_allclose(likeliest, reference.topk(2).values.tolist(), atol=1e-4)


@pytest.mark.parametrize("variant", ["preemption", "preemption-host-tier"])
def test_prompt_logprobs_survive_preemption(make_model: Callable[..., Path], variant: str) -> None:
    """A request preempted while its prompt runs, or after, and recomputed (or resumed from the host tier)
    hands out its prompt's logprobs once, whole."""
    model_dir = make_model("llama", "tiny")
    prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    llm = LLM(str(model_dir), dtype="float32", **ENGINE_VARIANTS[variant])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=2))
    assert llm.llm_engine.stats.num_preempted_total > 0, "the pool was meant to be too small for the batch"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs, strict=True):
            assert_prompt_logprobs_match(
                prompt, output.prompt_logprobs, model(torch.tensor([prompt])).logits[0], 2
            )


# RoPE scaling past the original context, chunked prefill forced. Each case is a tiny model whose
# config.json asks for one rope_type, pretrained (max_position_embeddings or original_max_position_embeddings)
# for 64 positions; two prompts run past that, one stays under it and crosses it while decoding.
ORIGINAL = 64
MAX_MODEL_LEN = 4 * ORIGINAL
# Prompt lengths: two past the original context, one under it that crosses it while decoding.
PROMPT_LENGTHS = (150, 90, 60)


def _head_dim(arch: str) -> int:
    return 32 if arch == "qwen3" else 16  # the tiny preset's (make_model doubles Qwen3's)


def _rope_case(rope_type: str, arch: str) -> tuple[int, dict]:
    """(max_position_embeddings, rope_parameters) of the case's model."""
    theta = {"rope_theta": 10000.0}
    if rope_type == "linear":
        return ORIGINAL, {"rope_type": "linear", "factor": 4.0, **theta}
    if rope_type == "dynamic":
        return ORIGINAL, {"rope_type": "dynamic", "factor": 4.0, **theta}
    if rope_type == "yarn":
        return ORIGINAL, {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            "beta_fast": 8.0,
            **theta,
        }
    if rope_type == "llama3":
        return MAX_MODEL_LEN, {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            **theta,
        }
    half = _head_dim(arch) // 2
    return MAX_MODEL_LEN, {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.8 * i for i in range(half)],
        "original_max_position_embeddings": ORIGINAL,
        **theta,
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope", "llama3"])
def test_rope_scaling_past_the_original_context_matches_transformers(
    rope_type: str, arch: str, make_model: Callable[..., Path]
) -> None:
    max_positions, rope = _rope_case(rope_type, arch)
    model_dir = make_model(
        arch,
        "tiny",
        0,
        "--max-position-embeddings",
        str(max_positions),
        "--rope-parameters",
        json.dumps(rope),
    )
    rng = random.Random(17)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(16, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    # The others start like the first, so their first blocks are prefix-cache candidates: right for the
    # position-only rope types, wrong where the first prompt's length changed its rotation.
    prompts[1][:80] = prompts[0][:80]
    prompts[2][:48] = prompts[0][:48]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=256,
        enable_prefix_caching=True,
    )
    assert llm.llm_engine.max_model_len == MAX_MODEL_LEN
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    _assert_close(outputs, _reference(model_dir, prompts))


def test_greedy_matches_transformers_with_the_same_hf_overrides(make_model: Callable[..., Path]) -> None:
    """vLLM's hf_overrides change the model as Transformers' config keywords do: here another RoPE base and a
    far larger RMSNorm epsilon, which move the greedy tokens."""
    model_dir = make_model("llama", "tiny")
    overrides = {"rms_norm_eps": 0.25, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}
    prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])[:6]
    overridden = _reference(model_dir, prompts, **overrides)
    as_written = _reference(model_dir, prompts)
    assert [tokens for tokens, _ in overridden] != [tokens for tokens, _ in as_written]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=256,
        hf_overrides=overrides,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    _assert_close(llm.generate(prompts, params), overridden)


# Sliding windows: Mistral's on every layer, Qwen's from max_window_layers on (layer 0 attends to everything,
# layer 1 to its window). Prompts run well past the 24-token window, in chunks, sharing a prefix.
WINDOW = 24


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_sliding_window_past_the_window_matches_transformers(
    arch: str, backend: str, make_model: Callable[..., Path]
) -> None:
    options = ["--sliding-window", str(WINDOW)]
    if arch != "mistral":
        options += ["--max-window-layers", "1"]
    model_dir = make_model(arch, "tiny", 0, *options)
    rng = random.Random(23)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(16, vocab) for _ in range(n)] for n in (110, 75, 20)]
    prompts[1][:64] = prompts[0][:64]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=256,
        block_size=8,
        enable_prefix_caching=True,
        attention_backend=backend,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    _assert_close(outputs, _reference(model_dir, prompts))
    assert llm.llm_engine.stats.prefix_cache_hits > 0


def test_blocks_out_of_the_window_are_freed_as_requests_grow(make_model: Callable[..., Path]) -> None:
    # 4 requests of 150 tokens need 600 tokens of KV at full length; the cache holds 160, so keeping every
    # block would run them one at a time. With every layer sliding over 24 tokens, each keeps only its
    # window's blocks and a chunk's, and all four run side by side.
    model_dir = make_model("mistral", "tiny", 0, "--sliding-window", str(WINDOW))
    rng = random.Random(29)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(16, vocab) for _ in range(150 - MAX_TOKENS)] for _ in range(4)]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=160,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=20,
        block_size=8,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished, most_running = {}, 0
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
        most_running = max(most_running, engine.stats.num_running)
    assert most_running == 4
    assert engine.stats.num_preempted_total == 0
    _assert_close([finished[str(i)] for i in range(4)], _reference(model_dir, prompts))


# Long prompts on the torch backend: contexts past its long-context threshold attend in KV tiles. A 10K-token
# prompt in 1K-token chunks, with YaRN past a 4K original context, and with a 4K sliding window.
LONG_PROMPT = 10_000
YARN_4K = json.dumps({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
LONG_CASES = {
    "llama-yarn": ("llama", ["--max-position-embeddings", "4096", "--rope-parameters", YARN_4K]),
    "mistral-window": ("mistral", ["--max-position-embeddings", "16384", "--sliding-window", "4096"]),
}


@pytest.mark.parametrize("case", list(LONG_CASES))
def test_long_prompt_in_kv_tiles_matches_transformers(case: str, make_model: Callable[..., Path]) -> None:
    arch, options = LONG_CASES[case]
    model_dir = make_model(arch, "tiny", 0, *options)
    rng = random.Random(31)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = [rng.randrange(16, vocab) for _ in range(LONG_PROMPT)]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=16384,
        max_num_batched_tokens=1024,
        attention_backend="sdpa",
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
    _assert_close(llm.generate([prompt], params), _reference(model_dir, [prompt]))


HALF_PRECISION_CHECK = Path(__file__).with_name("support") / "half_precision_greedy.py"


@pytest.mark.parametrize("capability", ["host", "avx2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_transformers_on_this_cpu_and_masked_to_avx2(
    make_model: Callable[..., Path], capability: str, dtype: str
) -> None:
    # Both sides run in one process whose torch sees the CPU as ATEN_CPU_CAPABILITY says, so that `avx2`
    # takes an AVX2-only CPU's paths on any machine: ATen's AVX2 kernels, and projections left unpacked,
    # since oneDNN's packed half-precision kernels need AVX-512 (or AVX-NE-CONVERT).
    env = {k: v for k, v in os.environ.items() if k != cpu_features.CAPABILITY_ENV_VAR}
    if capability == "avx2":
        env |= {cpu_features.CAPABILITY_ENV_VAR: "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    model_dir = make_model("llama", "tiny")
    prompts = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])[:4]
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            str(HALF_PRECISION_CHECK),
            str(model_dir),
            dtype,
            str(MAX_TOKENS),
            json.dumps(prompts),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    packs_here = capability == "host" and cpu_features.onednn_packs(getattr(torch, dtype))
    assert ("projections packed for oneDNN" in result.stderr) == packs_here
    assert (f"{dtype} projections run unpacked" in result.stderr) == (not packs_here)
    for i, case in enumerate(json.loads(result.stdout)):
        tops, ref_tops = ([set(top) for top in case[key]] for key in ("tops", "reference_tops"))
        _assert_sequence_close(
            f"{dtype} prompt {i}", case["tokens"], tops, case["reference_tokens"], ref_tops
        )
