"""vLLM's prompt embeddings offline (`LLM(enable_prompt_embeds=True)`, a prompt dict's "prompt_embeds"):
greedy tokens equal Transformers' generate(inputs_embeds=...), in chunks smaller than the prompt, beside a
token prompt, and with prefix-cache hits for embeddings met again but never for other embeddings of the same
length; what the engine cannot take is refused by what is wrong with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from transformers import AutoModelForCausalLM

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _random_embeddings(model: AutoModelForCausalLM, tokens: int, seed: int) -> torch.Tensor:
    """Embeddings of no token, of the scale of the model's own."""
    weight = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, weight.shape[1], generator=generator) * weight.std().item()


def _transformers_tokens(model: AutoModelForCausalLM, embeddings: torch.Tensor) -> list[int]:
    with torch.inference_mode():
        generated = model.generate(
            inputs_embeds=embeddings[None],
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return generated[0].tolist()


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    """Prompts in chunks of 8 tokens, and blocks of 4 for the prefix cache."""
    return LLM(
        str(tiny_llama),
        dtype="float32",
        enable_prompt_embeds=True,
        num_gpu_blocks_override=256,
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=8,
    )


def test_prompt_embeddings_continue_as_transformers_continues_them(
    llm: LLM, model: AutoModelForCausalLM
) -> None:
    first, second = _random_embeddings(model, 21, seed=1), _random_embeddings(model, 21, seed=2)
    token_ids = [5, 17, 99, 3, 250, 41]
    own = model.get_input_embeddings()(torch.tensor(token_ids)).detach()
    prompts = [{"prompt_embeds": first}, token_ids, {"prompt_embeds": second[None]}, {"prompt_embeds": own}]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [_transformers_tokens(model, embeddings) for embeddings in (first, own, second, own)]
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert [len(output.prompt_token_ids) for output in outputs] == [21, 6, 21, 6]
    # Five blocks of 21 rows each, shared by no other prompt: no hit between first and second.
    hits = llm.llm_engine.stats.prefix_cache_hits
    assert hits == 0
    again = llm.generate([{"prompt_embeds": first}], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    assert again[0].outputs[0].token_ids == expected[0]


@pytest.mark.parametrize(
    ("embeddings", "words"),
    [
        (torch.zeros(3, 7), "prompt embeddings of shape [3, 7] for a prompt of shape [3, 64]"),
        (torch.zeros(64), "[tokens, hidden size], not [64]"),
        (torch.zeros(2, 3, 64), "[tokens, hidden size], not [2, 3, 64]"),
        (torch.zeros(3, 64, dtype=torch.int64), "floating point"),
        (torch.full((3, 64), float("nan")), "finite"),
    ],
)
def test_embeddings_it_cannot_take_are_refused(llm: LLM, embeddings: torch.Tensor, words: str) -> None:
    """Before anything is queued, as other bad input offline."""
    with pytest.raises(ValueError) as caught:
        llm.generate({"prompt_embeds": embeddings}, GREEDY, use_tqdm=False)
    assert words in str(caught.value)


def test_an_engine_without_the_switch_refuses_them(tiny_llama: Path, model: AutoModelForCausalLM) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=256)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        llm.generate({"prompt_embeds": _random_embeddings(model, 4, seed=3)}, GREEDY, use_tqdm=False)
