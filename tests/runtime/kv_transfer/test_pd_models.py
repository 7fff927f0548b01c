"""Prefill on one engine and decode on another for every text architecture, a LoRA adapter and a vision model:
greedy tokens equal the independent oracle's (Transformers, PEFT), and the KV really crossed (blocks pulled,
only the last prompt token computed on the decode side)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvfleet.contract.kv_transfer import DO_REMOTE_DECODE, PREFILL_MAX_TOKENS
from kvfleet.runtime import LLM, LoRARequest
from kvfleet.runtime.lora.make_adapter import make_adapter
from pd_engines import (
    MAX_TOKENS,
    decode,
    greedy,
    make_llm,
    prefill,
    random_prompts,
    release_holds,
    shutdown,
    stats,
)
from peft import PeftModel
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor, LlavaForConditionalGeneration


def _greedy_reference(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    with torch.inference_mode():
        return [
            model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            for prompt in prompts
        ]


def _crossed(consumer: LLM, run: Callable[[], list[list[int]]], num_prompts: int) -> list[list[int]]:
    """run()'s tokens, checking that each of its prompts pulled its KV and computed one prompt token."""
    before = stats(consumer)
    tokens = run()
    after = stats(consumer)
    assert after.kv_transfer_loads - before.kv_transfer_loads == num_prompts
    assert after.kv_transfer_blocks_pulled > before.kv_transfer_blocks_pulled
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == num_prompts
    assert after.kv_transfer_fallbacks == {}
    return tokens


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_each_text_architecture_equals_transformers(arch: str, make_model: Callable[..., Path]) -> None:
    # The llama is test_pd_tokens.py's.
    model_dir = make_model(arch, "tiny")
    prompts = random_prompts(4, [9, 33, 70], seed=11)
    expected = _greedy_reference(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts
    )
    producer = make_llm(model_dir, "kv_producer", max_num_batched_tokens=32)
    consumer = make_llm(model_dir, "kv_consumer")
    try:
        tokens = _crossed(
            consumer, lambda: decode(consumer, prompts, prefill(producer, prompts)), len(prompts)
        )
        assert tokens == expected
        release_holds(producer)
    finally:
        shutdown(producer, consumer)


def test_a_lora_adapter_equals_peft_and_never_lands_on_the_base_models_blocks(
    tiny_llama: Path, tmp_path: Path
) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", rank=8, seed=3)
    prompts = random_prompts(3, [20, 41], seed=12)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    base_expected = _greedy_reference(base, prompts[:1])
    expected = _greedy_reference(PeftModel.from_pretrained(base, adapter).eval(), prompts)
    lora_options = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    # Offers never pulled are let go of quickly.
    producer = make_llm(tiny_llama, "kv_producer", extra_config={"hold_timeout_s": 1}, **lora_options)
    consumer = make_llm(tiny_llama, "kv_consumer", **lora_options)
    # The decode side knows the adapter by another id: its KV is the same all the same.
    on_producer, on_consumer = (
        LoRARequest("adapter", 1, str(adapter)),
        LoRARequest("adapter", 7, str(adapter)),
    )
    try:
        outputs = producer.generate(
            prompts, greedy(PREFILL_MAX_TOKENS, {DO_REMOTE_DECODE: True}), lora_request=on_producer
        )
        params = [output.kv_transfer_params for output in outputs]

        def run() -> list[list[int]]:
            sampling = [greedy(kv_transfer_params=p) for p in params]
            answers = consumer.generate(prompts, sampling, lora_request=on_consumer)
            return [answer.outputs[0].token_ids for answer in answers]

        assert _crossed(consumer, run, len(prompts)) == expected
        # The adapter's KV offered to a request of the base model: the digests differ, nothing is pulled, and
        # the base model's own tokens come out by recompute.
        again = producer.generate(
            prompts[:1], greedy(PREFILL_MAX_TOKENS, {DO_REMOTE_DECODE: True}), lora_request=on_producer
        )[0].kv_transfer_params
        before = stats(consumer)
        assert decode(consumer, prompts[:1], [again]) == base_expected
        after = stats(consumer)
        assert after.kv_transfer_blocks_pulled == before.kv_transfer_blocks_pulled
        assert sum(after.kv_transfer_fallbacks.values()) == sum(before.kv_transfer_fallbacks.values()) + 1
        release_holds(producer)
    finally:
        shutdown(producer, consumer)


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(40, 52, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_a_vision_model_equals_transformers(make_model: Callable[..., Path]) -> None:
    llava = make_model("llava", "tiny")
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Describe this picture:"}, {"type": "image"}]}
    ]
    image = _image(5)
    processor = AutoProcessor.from_pretrained(llava, use_fast=False)
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt", add_special_tokens=False)
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )[0, inputs["input_ids"].shape[1] :].tolist()
    producer = make_llm(llava, "kv_producer", block_size=8, extra_config={"hold_timeout_s": 1})
    consumer = make_llm(llava, "kv_consumer", block_size=8)
    try:
        prompt = {"prompt_token_ids": producer.apply_chat_template(conversation)}
        prompt["multi_modal_data"] = {"image": [image]}

        def run() -> list[list[int]]:
            offered = producer.generate([prompt], greedy(PREFILL_MAX_TOKENS, {DO_REMOTE_DECODE: True}))
            answer = consumer.generate([prompt], greedy(kv_transfer_params=offered[0].kv_transfer_params))
            return [answer[0].outputs[0].token_ids]

        assert _crossed(consumer, run, 1) == [reference]
        # Another image behind the same placeholders: its blocks are not the first image's.
        other = {**prompt, "multi_modal_data": {"image": [_image(6)]}}
        offered = producer.generate([prompt], greedy(PREFILL_MAX_TOKENS, {DO_REMOTE_DECODE: True}))
        before = stats(consumer)
        consumer.generate([other], greedy(kv_transfer_params=offered[0].kv_transfer_params))
        after = stats(consumer)
        assert after.kv_transfer_blocks_pulled == before.kv_transfer_blocks_pulled
        assert sum(after.kv_transfer_fallbacks.values()) == sum(before.kv_transfer_fallbacks.values()) + 1
        release_holds(producer)
    finally:
        shutdown(producer, consumer)
