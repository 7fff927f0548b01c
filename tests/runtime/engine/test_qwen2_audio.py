"""Qwen2-Audio against Transformers' Qwen2AudioProcessor and Qwen2AudioForConditionalGeneration on the same
folder (float32, CPU): the same expanded prompts, and greedy outputs under the top-5 criterion of
test_llm_vs_transformers, for a mixed batch of text-only, one-clip and two-clip requests with prefix caching
on and chunked prefill splitting clips. Then the encoder cache and the prefix cache's audio keys by the
engine's own counters, resampling against a clip recorded at the model's rate, and the limits."""

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
from kvfleet.runtime.multimodal.inputs import MediaInputError
from test_llm_vs_transformers import MAX_TOKENS, TOP_N, _assert_close, greedy_reference
from transformers import AutoConfig, AutoProcessor, Qwen2AudioForConditionalGeneration

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N)
RATE = 16000


def _clip(seed: int, seconds: float, rate: int = RATE) -> np.ndarray:
    """A chirp over noise: a spectrum that changes along the clip, as speech's does."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    chirp = np.sin(2 * np.pi * (200 + 300 * seed + 400 * t) * t)
    return (0.5 * chirp + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)


# 0.7 s, 1.6 s and 1 s: 17, 40 and 25 audio tokens.
CLIPS = [_clip(0, 0.7), _clip(1, 1.6), _clip(2, 1.0)]


def _conversation(text: str, num_clips: int, audio_first: bool = False) -> list[dict]:
    """A user turn with the clips before or between pieces of text."""
    parts: list[dict] = [{"type": "text", "text": text}]
    for index in range(num_clips):
        audio = {"type": "audio"}
        if audio_first and index == 0:
            parts.insert(0, audio)
        else:
            parts += [audio, {"type": "text", "text": f" and clip {index}"}]
    return [{"role": "user", "content": parts}]


# (conversation, clips): text only, one clip, two clips, the same text with another clip, a clip before the
# text, and the second case again (a prefix-cache and encoder-cache repeat).
CASES = [
    (_conversation("Tell me a story about the harbour.", 0), []),
    (_conversation("What do you hear?", 1), [CLIPS[0]]),
    (_conversation("Compare", 2), [CLIPS[1], CLIPS[2]]),
    (_conversation("What do you hear?", 1), [CLIPS[2]]),
    (_conversation("Transcribe it.", 1, audio_first=True), [CLIPS[0]]),
    (_conversation("What do you hear?", 1), [CLIPS[0]]),
]


@pytest.fixture(scope="module")
def qwen2_audio(make_model: Callable[..., Path]) -> Path:
    return make_model("qwen2-audio", "tiny")


@pytest.fixture(scope="module")
def reference(qwen2_audio: Path) -> list[tuple[list[int], tuple[list[int], list[set[int]]]]]:
    """Per case: Transformers' expanded prompt, and its greedy tokens with the top-5 at each step."""
    processor = AutoProcessor.from_pretrained(qwen2_audio)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(qwen2_audio, dtype=torch.float32).eval()
    results = []
    for conversation, clips in CASES:
        text = processor.apply_chat_template(conversation, add_generation_prompt=True)
        inputs = processor(text=text, audio=clips or None, sampling_rate=RATE, return_tensors="pt")
        results.append((inputs["input_ids"][0].tolist(), greedy_reference(model, **inputs)))
    return results


def _prompts(llm: LLM) -> list[dict]:
    return [
        {
            "prompt_token_ids": llm.apply_chat_template(conversation),
            "multi_modal_data": {"audio": [(clip, RATE) for clip in clips]},
        }
        for conversation, clips in CASES
    ]


def test_transformers_loads_every_tensor_of_the_folder(qwen2_audio: Path) -> None:
    _, info = Qwen2AudioForConditionalGeneration.from_pretrained(
        qwen2_audio, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    processor = AutoProcessor.from_pretrained(qwen2_audio)
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    assert processor.audio_token_id == AutoConfig.from_pretrained(qwen2_audio).audio_token_index
    rendered = processor.apply_chat_template(_conversation("Hi", 1), add_generation_prompt=True)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>" in rendered


# 16 tokens a step: the 17 to 40 placeholders of each clip are fed over two to four steps.
VARIANTS = {
    "chunked-prefill": dict(max_num_batched_tokens=16, block_size=8),
    "whole-prompts": dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(qwen2_audio: Path, reference, variant: str) -> None:
    llm = LLM(
        str(qwen2_audio),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=256,
        enable_prefix_caching=True,
        **VARIANTS[variant],
    )
    outputs = llm.generate(_prompts(llm), GREEDY)
    assert [output.prompt_token_ids for output in outputs] == [prompt for prompt, _ in reference]
    _assert_close(outputs, [expected for _, expected in reference])
    # Five clips in the batch, three of them different; the repeat of case 1 hit the prefix cache.
    runner = llm.llm_engine.runner.encoder_runner
    assert runner is not None and runner.num_encoder_runs == 3
    assert llm.llm_engine.stats.prefix_cache_hits > 0


def test_same_clip_is_encoded_once_and_other_clips_miss_the_prefix_cache(qwen2_audio: Path) -> None:
    llm = LLM(str(qwen2_audio), dtype="float32", num_gpu_blocks_override=256, max_model_len=256, block_size=8)
    core = llm.llm_engine.engine_core
    prompt = _prompts(llm)[1]  # "What do you hear?" with CLIPS[0]
    audio_offset = prompt["prompt_token_ids"].index(core.modalities["audio"].placeholder_id)
    short = SamplingParams(temperature=0.0, max_tokens=2)

    def run(clip: np.ndarray) -> tuple[int, int]:
        """(encoder runs, prefix-cache hit tokens) that one request added."""
        before = core.stats
        (output,) = llm.generate({**prompt, "multi_modal_data": {"audio": (clip, RATE)}}, short)
        after = core.stats
        assert len(output.outputs[0].token_ids) == 2
        return after.encoder_runs - before.encoder_runs, after.prefix_cache_hits - before.prefix_cache_hits

    num_tokens = len(prompt["prompt_token_ids"]) - 1 + 17  # the placeholder becomes 17
    assert run(CLIPS[0]) == (1, 0)
    # The same clip again: nothing encoded; every whole block before the last token is a hit.
    runs, hits = run(CLIPS[0].copy())
    assert runs == 0 and hits == (num_tokens - 1) // 8 * 8
    # The same text with another clip: encoded, and no block holding an audio placeholder is a hit.
    runs, hits = run(CLIPS[2])
    assert runs == 1 and hits == audio_offset // 8 * 8


def test_encoder_budget_spreads_clips_over_steps_while_text_decodes(qwen2_audio: Path) -> None:
    """A budget of one 30 s clip (750 tokens) per step: a prompt of two 16 s clips (400 tokens each) encodes
    one a step, and a text request running beside it gets a token in every step."""
    config = EngineConfig(
        model=str(qwen2_audio),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_encoder_input_tokens=750,
    )
    engine = LLMEngine(config)

    def prompt(conversation: list[dict]) -> list[int]:
        return chat_prompt_token_ids(engine.tokenizer, conversation, add_generation_prompt=True)

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    delta = OutputKind.DELTA
    engine.add_request(
        "text", "", params, prompt_token_ids=prompt(_conversation("A story.", 0)), output_kind=delta
    )
    engine.step()
    clips = [(_clip(3, 16.0), RATE), (_clip(4, 16.0), RATE)]
    token_ids, features = engine.prompt_media.prepare(prompt(_conversation("Two:", 2)), {"audio": clips})
    assert [feature.length for feature in features] == [400, 400]
    engine.add_request(
        "audio", "", params, prompt_token_ids=token_ids, mm_features=features, output_kind=delta
    )
    runs = []
    text_tokens = []
    while len(runs) < 3:
        before = engine.engine_core.stats.encoder_runs
        outputs = {output.request_id: output for output in engine.step()}
        runs.append(engine.engine_core.stats.encoder_runs - before)
        text_tokens.append(len(outputs["text"].outputs[0].token_ids) if "text" in outputs else 0)
    assert runs == [1, 1, 0]
    assert all(count >= 1 for count in text_tokens)


def test_a_clip_at_another_rate_is_resampled(qwen2_audio: Path) -> None:
    """A tone recorded at 44.1 kHz gives the features of the same tone recorded at 16 kHz."""
    llm = LLM(str(qwen2_audio), dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    media = llm.llm_engine.prompt_media

    def tone(rate: int) -> np.ndarray:
        t = np.arange(rate) / rate
        return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1750 * t)).astype(np.float32)

    native = media.preprocess("audio", (tone(RATE), RATE))
    resampled = media.preprocess("audio", (tone(44100), 44100))
    assert (resampled.unpadded_length, resampled.num_tokens) == (native.unpadded_length, native.num_tokens)
    frames = native.unpadded_length
    np.testing.assert_allclose(resampled.data[:, 2 : frames - 2], native.data[:, 2 : frames - 2], atol=0.02)


def test_clips_past_the_limits_are_refused(qwen2_audio: Path) -> None:
    llm = LLM(
        str(qwen2_audio),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_model_len=256,
        limit_mm_per_prompt={"audio": 1},
        max_audio_clip_s=1.5,
    )
    prompts = _prompts(llm)
    with pytest.raises(MediaInputError, match="limit of 1 audio"):
        llm.generate({**prompts[2]}, GREEDY)  # two clips
    with pytest.raises(MediaInputError, match=r"more than the limit of 1\.5 s"):
        llm.generate({**prompts[1], "multi_modal_data": {"audio": (CLIPS[1], RATE)}}, GREEDY)
    with pytest.raises(MediaInputError, match="text and audio, not image"):
        llm.generate({**prompts[0], "multi_modal_data": {"image": [object()]}}, GREEDY)
    # Nothing was queued, and the engine serves the next request.
    (output,) = llm.generate(prompts[1], GREEDY)
    assert len(output.outputs[0].token_ids) == MAX_TOKENS
