"""LLaVA against Transformers' LlavaProcessor and LlavaForConditionalGeneration on the same folder (float32,
CPU): the same preprocessed pixels, the same expanded prompts, and greedy outputs under the top-5 criterion
of test_llm_vs_transformers, for a mixed batch of text-only, one-image and two-image requests with prefix
caching on and chunked prefill splitting images. Then the encoder cache, the prefix cache's image keys and
the encoder budget, by the engine's own counters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.chat_prompt import chat_prompt_token_ids
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.outputs import OutputKind
from kvfleet.runtime.multimodal.image_processor import ImageProcessor
from PIL import Image
from test_llm_vs_transformers import MAX_TOKENS, TOP_N, _assert_close, greedy_reference
from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

DELTA = OutputKind.DELTA
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)


def _image(seed: int, height: int, width: int) -> Image.Image:
    """Smooth gradients plus noise: resizing it means something, unlike pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    noisy = base + rng.normal(0, 40, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


IMAGES = [_image(0, 40, 52), _image(1, 64, 30), _image(2, 30, 30)]


def _conversation(text: str, num_images: int, image_first: bool = False) -> list[dict]:
    """A user turn with the images before or between pieces of text."""
    parts: list[dict] = [{"type": "text", "text": text}]
    for index in range(num_images):
        image = {"type": "image"}
        if image_first and index == 0:
            parts.insert(0, image)
        else:
            parts += [image, {"type": "text", "text": f" and picture {index}"}]
    return [{"role": "user", "content": parts}]


# (conversation, images): text only, one image, two images, the same text with another image, and the first
# case again (a prefix-cache and encoder-cache repeat).
CASES = [
    (_conversation("Tell me a story about the harbour.", 0), []),
    (_conversation("Describe this picture:", 1), [IMAGES[0]]),
    (_conversation("Compare", 2), [IMAGES[1], IMAGES[2]]),
    (_conversation("Describe this picture:", 1), [IMAGES[2]]),
    (_conversation("What is here?", 1, image_first=True), [IMAGES[0]]),
    (_conversation("Describe this picture:", 1), [IMAGES[0]]),
]


@pytest.fixture(scope="module")
def llava(make_model: Callable[..., Path]) -> Path:
    return make_model("llava", "tiny")


@pytest.fixture(scope="module")
def reference(llava: Path) -> list[tuple[list[int], tuple[list[int], list[set[int]]]]]:
    """Per case: Transformers' expanded prompt, and its greedy tokens with the top-5 at each step."""
    # The Pillow image processor, which the engine's resizing follows (with torchvision installed,
    # Transformers would pick its torchvision one).
    processor = AutoProcessor.from_pretrained(llava, use_fast=False)
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    results = []
    for conversation, images in CASES:
        text = processor.apply_chat_template(conversation, add_generation_prompt=True)
        # The rendered template holds the BOS token already.
        inputs = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
        results.append((inputs["input_ids"][0].tolist(), greedy_reference(model, **inputs)))
    return results


def _prompts(llm: LLM) -> list[dict]:
    return [
        {"prompt_token_ids": llm.apply_chat_template(conversation), "multi_modal_data": {"image": images}}
        for conversation, images in CASES
    ]


def test_transformers_loads_every_tensor_of_the_folder(llava: Path) -> None:
    _, info = LlavaForConditionalGeneration.from_pretrained(
        llava, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    processor = AutoProcessor.from_pretrained(llava, use_fast=False)
    assert type(processor).__name__ == "LlavaProcessor"
    assert processor.image_token_id == AutoConfig.from_pretrained(llava).image_token_id


def test_pixels_match_the_transformers_image_processor(llava: Path) -> None:
    theirs = AutoProcessor.from_pretrained(llava, use_fast=False).image_processor
    ours = ImageProcessor.from_folder(llava)
    for image in IMAGES:
        expected = theirs(images=[image], return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours(image), expected, atol=1e-5)


# 16 tokens a step: the 25 placeholders of each image are fed over two or three steps.
VARIANTS = {
    "chunked-prefill": dict(max_num_batched_tokens=16, block_size=8),
    "whole-prompts": dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(llava: Path, reference, variant: str) -> None:
    llm = LLM(
        str(llava),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=256,
        enable_prefix_caching=True,
        **VARIANTS[variant],
    )
    prompts = _prompts(llm)
    outputs = llm.generate(prompts, GREEDY)
    assert [output.prompt_token_ids for output in outputs] == [prompt for prompt, _ in reference]
    _assert_close(outputs, [expected for _, expected in reference])
    stats = llm.llm_engine.stats
    # Five images in the batch, three of them different; the repeat of case 1 hit the prefix cache.
    runner = llm.llm_engine.runner.encoder_runner
    assert runner is not None and runner.num_encoder_runs == 3
    assert stats.prefix_cache_hits > 0


def test_same_image_is_encoded_once_and_other_images_miss_the_prefix_cache(llava: Path) -> None:
    llm = LLM(str(llava), dtype="float32", num_gpu_blocks_override=256, max_model_len=256, block_size=8)
    engine = llm.llm_engine
    prompt = _prompts(llm)[1]  # "Describe this picture:" with IMAGES[0]
    image_offset = prompt["prompt_token_ids"].index(engine.engine_core.modalities["image"].placeholder_id)
    short = SamplingParams(temperature=0.0, max_tokens=2)

    def run(image: Image.Image, request: dict = prompt) -> tuple[int, int]:
        """(encoder runs, prefix-cache hit tokens) that one request added."""
        before = engine.engine_core.stats
        (output,) = llm.generate({**request, "multi_modal_data": {"image": image}}, short)
        after = engine.engine_core.stats
        assert len(output.outputs[0].token_ids) == 2
        return after.encoder_runs - before.encoder_runs, after.prefix_cache_hits - before.prefix_cache_hits

    num_tokens = len(prompt["prompt_token_ids"]) - 1 + 25  # the placeholder becomes 25
    assert run(IMAGES[0]) == (1, 0)
    # The same image again: nothing encoded; every whole block before the last token is a hit.
    runs, hits = run(IMAGES[0])
    assert runs == 0 and hits == (num_tokens - 1) // 8 * 8
    # The same text with another image: encoded, and no block holding an image placeholder is a hit.
    runs, hits = run(IMAGES[1])
    assert runs == 1 and hits == image_offset // 8 * 8
    # The first image behind other text: the prefix cache has none of it, the encoder cache has the image.
    assert engine.engine_core.stats.encoder_cache_hits == 0
    other_text = _prompts(llm)[4]  # "What is here?" after IMAGES[0]
    assert run(IMAGES[0], other_text) == (0, 0)
    assert engine.engine_core.stats.encoder_cache_hits == 1


def test_encoder_budget_spreads_images_over_steps_while_text_decodes(llava: Path) -> None:
    """A budget of one image per step: a four-image prompt encodes one image a step, and a text request
    running beside it gets a token in every step."""
    config = EngineConfig(
        model=str(llava),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=256,
        max_num_encoder_input_tokens=25,
    )
    engine = LLMEngine(config)

    def prompt(conversation: list[dict]) -> list[int]:
        return chat_prompt_token_ids(engine.tokenizer, conversation, add_generation_prompt=True)

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request(
        "text", "", params, prompt_token_ids=prompt(_conversation("A story.", 0)), output_kind=DELTA
    )
    engine.step()
    images = [IMAGES[0], IMAGES[1], IMAGES[2], _image(3, 33, 33)]
    token_ids, features = engine.prompt_media.prepare(prompt(_conversation("Four:", 4)), {"image": images})
    engine.add_request(
        "images", "", params, prompt_token_ids=token_ids, mm_features=features, output_kind=DELTA
    )
    runs = []
    text_tokens = []
    while len(runs) < 5:
        before = engine.engine_core.stats.encoder_runs
        outputs = {output.request_id: output for output in engine.step()}
        runs.append(engine.engine_core.stats.encoder_runs - before)
        text_tokens.append(len(outputs["text"].outputs[0].token_ids) if "text" in outputs else 0)
    assert runs[:4] == [1, 1, 1, 1]
    assert all(count >= 1 for count in text_tokens)
