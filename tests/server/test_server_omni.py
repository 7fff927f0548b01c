"""Images and audio in one conversation, through the official openai SDK against a real server of a tiny
Qwen2.5-Omni thinker: a base64 image and a clip in one user message, and in two turns, answered as
Transformers answers them; a video part, and items past the limits, are 400s naming the part, after which the
server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import openai
import pytest
from PIL import Image
from server_checks import transformers_chat_answer
from test_server_audio import _audio_part, _pcm16, _user, _wav, _waveform
from transformers import Qwen2_5OmniThinkerForConditionalGeneration

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MAX_TOKENS = 6
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
RATE = 16000
MAX_IMAGE_PIXELS = 200 * 200


def _photo(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = [np.cos(2 * np.pi * (k + 2) * (x - seed * y)) for k in range(3)]
    pixels = 127 + 90 * np.stack(channels, axis=-1) + 25 * rng.standard_normal((height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _image_part(image: Image.Image) -> dict[str, Any]:
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def omni(make_model: Callable[..., Path]) -> Path:
    return make_model("qwen2.5-omni", "tiny")


@pytest.fixture(scope="module")
def omni_server(start_server: Callable[..., ServerProcess], omni: Path) -> ServerProcess:
    return start_server(
        "--limit-mm-per-prompt",
        '{"image": 2, "audio": 1}',
        "--max-image-pixels",
        str(MAX_IMAGE_PIXELS),
        # 16 tokens a step: images' and clips' placeholders are fed over several steps.
        "--max-num-batched-tokens",
        "16",
        model=omni,
    )


@pytest.fixture(scope="module")
def client(omni_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{omni_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _transformers_answer(folder: Path, messages: list[dict], images: list, clips: list) -> tuple[str, int]:
    return transformers_chat_answer(
        Qwen2_5OmniThinkerForConditionalGeneration,
        folder,
        messages,
        MAX_TOKENS,
        images=images,
        audio=[_pcm16(clip) for clip in clips],
        sampling_rate=RATE,
    )


def test_an_image_and_a_clip_in_one_message_match_transformers(client: openai.OpenAI, omni: Path) -> None:
    # 130 x 90 pixels: resized to 140 x 84, 5 x 3 image tokens.
    image, clip = _photo(1, 130, 90), _waveform(1, 1.2)
    messages = [
        {"role": "system", "content": "You see and listen."},
        _user("Look at ", _image_part(image), " and listen to ", _audio_part(_wav(clip)), ". What is it?"),
    ]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    answer, prompt_tokens = _transformers_answer(omni, messages, [image], [clip])
    assert chat.usage.prompt_tokens == prompt_tokens
    assert chat.choices[0].message.content == answer


def test_an_image_and_a_clip_in_two_turns_match_transformers(client: openai.OpenAI, omni: Path) -> None:
    image, clip = _photo(2, 112, 168), _waveform(2, 0.9)
    messages = [
        _user("Here is a picture: ", _image_part(image)),
        {"role": "assistant", "content": "I see it."},
        _user("And a sound: ", _audio_part(_wav(clip)), " Do they go together?"),
    ]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    answer, prompt_tokens = _transformers_answer(omni, messages, [image], [clip])
    assert chat.usage.prompt_tokens == prompt_tokens
    assert chat.choices[0].message.content == answer
    assert chat.usage.completion_tokens == MAX_TOKENS


BAD_PARTS = {
    "video": (
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        "got type 'video_url'",
    ),
    "too many pixels": (_image_part(_photo(3, 250, 200)), f"more than the limit of {MAX_IMAGE_PIXELS}"),
}


@pytest.mark.parametrize("case", list(BAD_PARTS))
def test_a_video_or_an_item_past_the_limits_is_a_400(client: openai.OpenAI, case: str) -> None:
    part, message = BAD_PARTS[case]
    clip = _audio_part(_wav(_waveform(4, 0.5)))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[_user("See ", part, clip)], **GREEDY)
    assert message in caught.value.body["message"], caught.value.body
    assert caught.value.body["param"] == "messages.0.content.1"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("Hear ", clip)], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_more_images_than_the_limit_is_a_400(client: openai.OpenAI) -> None:
    parts = [_image_part(_photo(seed, 56, 56)) for seed in range(3)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[_user("Three: ", *parts)], **GREEDY)
    assert "limit of 2 image" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.0.content.3"
