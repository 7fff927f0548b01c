"""Qwen2.5-Omni's thinker against Transformers' Qwen2_5OmniProcessor and
Qwen2_5OmniThinkerForConditionalGeneration on the same folder (float32, CPU): the same expanded prompts, and
greedy outputs under the top-5 criterion of test_llm_vs_transformers, for a mixed batch of text-only,
one-image, two-image, audio and image+audio requests with prefix caching on, chunked prefill splitting
images' placeholders, and preemption by recompute. Then M-RoPE's positions against Transformers'
get_rope_index, and the limits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.multimodal.inputs import MediaInputError
from kvfleet.runtime.multimodal.mrope import MRopePositions
from PIL import Image
from test_llm_vs_transformers import MAX_TOKENS, TOP_N, _assert_close, greedy_reference
from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
RATE = 16000


def _image(seed: int, width: int, height: int) -> Image.Image:
    """Smooth colour gradients with noise: neighbouring patches alike, as in photographs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = [np.sin(2 * np.pi * (k + 1) * (x + seed * y)) for k in range(3)]
    pixels = 127 + 100 * np.stack(channels, axis=-1) + 20 * rng.standard_normal((height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _clip(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    chirp = np.sin(2 * np.pi * (200 + 300 * seed + 400 * t) * t)
    return (0.5 * chirp + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)


# Sides that are multiples of 28 need no resizing: 112 x 84 gives 4 x 3 = 12 image tokens, 56 x 140 gives
# 2 x 5 = 10, 168 x 168 gives 6 x 6 = 36 (three 2 x 2 windows a side, so window attention splits it).
IMAGES = [_image(0, 112, 84), _image(1, 56, 140), _image(2, 168, 168)]
# 0.7 s and 2.3 s: 17 and 57 audio tokens, the second over two of the encoder's 2 s windows.
CLIPS = [_clip(0, 0.7), _clip(1, 2.3)]


def _conversation(*parts: str | int) -> list[dict]:
    """A user turn of text parts, and image (an int: "image") or audio (the int -1: "audio") parts."""
    content = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        else:
            content.append({"type": "image" if part >= 0 else "audio"})
    return [{"role": "user", "content": content}]


IMAGE, AUDIO = 0, -1
# (conversation, images, clips): text only, one image, two images, audio, image and audio, audio then an
# image, the same text with another image, and the one-image case again (a prefix-cache repeat).
CASES = [
    (_conversation("Tell me a story about the harbour."), [], []),
    (_conversation("What is in", IMAGE, "this picture?"), [IMAGES[0]], []),
    (_conversation("Compare", IMAGE, "with", IMAGE), [IMAGES[1], IMAGES[2]], []),
    (_conversation("What do you hear?", AUDIO), [], [CLIPS[0]]),
    (_conversation("Describe", IMAGE, "and", AUDIO, "together."), [IMAGES[2]], [CLIPS[1]]),
    (_conversation(AUDIO, "then", IMAGE), [IMAGES[1]], [CLIPS[0]]),
    (_conversation("What is in", IMAGE, "this picture?"), [IMAGES[1]], []),
    (_conversation("What is in", IMAGE, "this picture?"), [IMAGES[0]], []),
]


@pytest.fixture(scope="module")
def omni(make_model: Callable[..., Path]) -> Path:
    return make_model("qwen2.5-omni", "tiny")


def _processor(folder: Path):
    # The Pillow image processor, which the engine's resizing follows (with torchvision installed, as
    # Qwen2_5OmniProcessor's video processor needs, Transformers would pick its torchvision one).
    return AutoProcessor.from_pretrained(folder, use_fast=False)


@pytest.fixture(scope="module")
def reference(omni: Path) -> list[tuple[list[int], tuple[list[int], list[set[int]]]]]:
    """Per case: Transformers' expanded prompt, and its greedy tokens with the top-5 at each step."""
    processor = _processor(omni)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni, dtype=torch.float32).eval()
    results = []
    for conversation, images, clips in CASES:
        text = processor.apply_chat_template(conversation, add_generation_prompt=True)
        inputs = processor(
            text=text, images=images or None, audio=clips or None, sampling_rate=RATE, return_tensors="pt"
        )
        results.append((inputs["input_ids"][0].tolist(), greedy_reference(model, **inputs)))
    return results


def _prompts(llm: LLM) -> list[dict]:
    return [
        {
            "prompt_token_ids": llm.apply_chat_template(conversation),
            "multi_modal_data": {"image": images, "audio": [(clip, RATE) for clip in clips]},
        }
        for conversation, images, clips in CASES
    ]


def test_transformers_loads_every_tensor_of_the_folder(omni: Path) -> None:
    _, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        omni, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    processor = _processor(omni)
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"
    rendered = processor.apply_chat_template(_conversation("Hi", IMAGE, AUDIO), add_generation_prompt=True)
    assert "<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>" in rendered


# 8 tokens a step: every image's placeholders (10 to 36) are fed over two to five steps. 40 blocks of 4 for
# eight requests of up to ~120 tokens: requests are preempted and recomputed.
VARIANTS = {
    "chunked-prefill": dict(
        max_num_batched_tokens=8, block_size=4, num_gpu_blocks_override=256, max_model_len=256
    ),
    "preemption": dict(
        max_num_batched_tokens=64, block_size=4, num_gpu_blocks_override=40, max_model_len=160
    ),
    "whole-prompts": dict(
        enable_chunked_prefill=False,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=256,
        max_model_len=256,
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(omni: Path, reference, variant: str) -> None:
    llm = LLM(str(omni), dtype="float32", enable_prefix_caching=True, **VARIANTS[variant])
    outputs = llm.generate(_prompts(llm), GREEDY)
    assert [output.prompt_token_ids for output in outputs] == [prompt for prompt, _ in reference]
    _assert_close(outputs, [expected for _, expected in reference])
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    if variant == "preemption":
        assert llm.llm_engine.stats.num_preempted_total > 0


def test_positions_match_transformers_rope_index(omni: Path, reference) -> None:
    """Each prompt's three rows of positions and its delta, as Transformers' get_rope_index gives them."""
    processor = _processor(omni)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni, dtype=torch.float32)
    llm = LLM(str(omni), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    media = llm.llm_engine.prompt_media
    for (conversation, images, clips), (prompt, _) in zip(CASES, reference, strict=True):
        token_ids, features = media.prepare(
            llm.apply_chat_template(conversation),
            {"image": images, "audio": [(clip, RATE) for clip in clips]},
        )
        assert token_ids == prompt
        ours = MRopePositions.of(len(token_ids), features, media.specs)
        inputs = processor(
            text=processor.apply_chat_template(conversation, add_generation_prompt=True),
            images=images or None,
            audio=clips or None,
            sampling_rate=RATE,
            return_tensors="pt",
        )
        mask = inputs.get("feature_attention_mask")
        positions, delta = model.get_rope_index(
            inputs["input_ids"],
            inputs.get("image_grid_thw"),
            None,
            inputs["attention_mask"],
            False,
            None if mask is None else mask.sum(-1),
        )
        assert ours.prompt.tolist() == positions[:, 0].tolist()
        assert ours.delta == int(delta[0, 0])
        later = len(token_ids) + 3
        assert ours.rows(later, later + 1).tolist() == [[later + ours.delta]] * 3


def test_a_resized_image_gives_transformers_pixels(omni: Path) -> None:
    """An image of sides not multiples of 28 (and one past the pixel limit) is resized as Transformers'
    processor resizes it: the same grid, and the same pixels patch by patch."""
    processor = _processor(omni)
    llm = LLM(str(omni), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    media = llm.llm_engine.prompt_media
    for image in (_image(3, 101, 67), _image(4, 400, 300)):
        (item,) = [media.preprocess("image", image)]
        expected = processor.image_processor(images=[image], return_tensors="np")
        _, rows, cols = expected["image_grid_thw"][0]
        assert list(item.data.shape) == [3, rows * 14, cols * 14]
        patches = item.data.reshape(3, rows // 2, 2, 14, cols // 2, 2, 14).transpose(1, 4, 2, 5, 0, 3, 6)
        theirs = expected["pixel_values"].reshape(rows * cols, 3, 2, 14, 14)[:, :, 0]
        np.testing.assert_allclose(patches.reshape(rows * cols, 3, 14, 14), theirs, atol=1e-5)


def test_limits_and_refusals(omni: Path, tmp_path: Path) -> None:
    llm = LLM(
        str(omni),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=64,
        limit_mm_per_prompt={"image": 1},
    )
    prompt = llm.apply_chat_template(_conversation("Two", IMAGE, IMAGE))
    with pytest.raises(MediaInputError, match="limit of 1 image"):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": IMAGES[:2]}}, GREEDY)
    with pytest.raises(MediaInputError, match="takes text and image and audio, not video"):
        llm.llm_engine.prompt_media.check_count("video", 1)
    with pytest.raises(MediaInputError, match="aspect ratio"):
        llm.llm_engine.prompt_media.preprocess("image", _image(5, 600, 2))
    # The whole model (thinker, talker and speech decoder) is refused, naming what to serve instead.
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2_5OmniForConditionalGeneration"], "thinker_config": {}})
    )
    with pytest.raises(ValueError, match="serve a folder of its thinker alone"):
        ModelConfig.from_folder(whole)
