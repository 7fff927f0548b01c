"""Audio in chat requests (OpenAI's input_audio parts), through the official openai SDK against a real server
of a tiny Qwen2-Audio: answers equal to Transformers' greedy ones, the encoder cache by the server's
metrics, WAV at another rate and MP3 decoded, and a clear 400 naming the content part for each kind of bad
clip, after which the server keeps serving."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import openai
import pytest
import soundfile
from PIL import Image
from server_checks import encoder_runs, transformers_chat_answer
from transformers import Qwen2AudioForConditionalGeneration

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MAX_TOKENS = 6
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
MAX_AUDIO_CLIP_S = 2
RATE = 16000


def _waveform(seed: int, seconds: float, rate: int = RATE, channels: int = 1) -> np.ndarray:
    """[samples, channels] of a chirp over noise, in [-0.6, 0.6]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    chirp = np.sin(2 * np.pi * (300 + 200 * seed + 500 * t) * t)
    mono = 0.5 * chirp + 0.1 * np.clip(rng.standard_normal(t.shape), -1, 1)
    return np.repeat(mono[:, None], channels, axis=1)


def _wav(waveform: np.ndarray, rate: int = RATE) -> bytes:
    """16-bit PCM WAV, written by the standard library's wave module."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(waveform.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((waveform * 32767).round().astype("<i2").tobytes())
    return buffer.getvalue()


def _pcm16(waveform: np.ndarray) -> np.ndarray:
    """What a 16-bit PCM WAV of the waveform decodes to, mono, as float."""
    return ((waveform * 32767).round().astype(np.int16) / 32768.0).mean(axis=1)


def _audio_part(data: bytes, audio_format: str = "wav") -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format},
    }


def _user(*parts: dict[str, Any] | str) -> dict[str, Any]:
    content = [{"type": "text", "text": part} if isinstance(part, str) else part for part in parts]
    return {"role": "user", "content": content}


@pytest.fixture(scope="module")
def qwen2_audio(make_model: Callable[..., Path]) -> Path:
    return make_model("qwen2-audio", "tiny")


@pytest.fixture(scope="module")
def audio_server(start_server: Callable[..., ServerProcess], qwen2_audio: Path) -> ServerProcess:
    return start_server(
        "--limit-mm-per-prompt",
        '{"image": 2, "audio": 1}',
        "--max-audio-clip-s",
        str(MAX_AUDIO_CLIP_S),
        # 16 tokens a step: a clip's placeholders are fed over several steps.
        "--max-num-batched-tokens",
        "16",
        model=qwen2_audio,
    )


@pytest.fixture(scope="module")
def client(audio_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{audio_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_an_audio_clip_in_a_conversation_matches_transformers(
    client: openai.OpenAI, qwen2_audio: Path
) -> None:
    waveform = _waveform(1, 1.3)
    messages = [
        {"role": "system", "content": "You listen carefully."},
        _user("Hello there."),
        {"role": "assistant", "content": "Hello. Send me a sound."},
        _user("What is in this clip: ", _audio_part(_wav(waveform)), "?"),
    ]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    answer, prompt_tokens = transformers_chat_answer(
        Qwen2AudioForConditionalGeneration,
        qwen2_audio,
        messages,
        MAX_TOKENS,
        audio=[_pcm16(waveform)],
        sampling_rate=RATE,
    )
    assert chat.usage.prompt_tokens == prompt_tokens
    assert chat.choices[0].message.content == answer


def test_the_same_clip_is_encoded_once(client: openai.OpenAI, audio_server: ServerProcess) -> None:
    part = _audio_part(_wav(_waveform(3, 0.8)))
    before = encoder_runs(audio_server)
    answers = [
        client.chat.completions.create(model=MODEL_NAME, messages=[_user("Listen: ", part)], **GREEDY)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert answers[0] == answers[1]
    assert encoder_runs(audio_server) - before == 1


def _prompt_tokens(client: openai.OpenAI, part: dict[str, Any]) -> int:
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("Listen: ", part)], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS
    return chat.usage.prompt_tokens


def test_stereo_at_another_rate_and_mp3_are_decoded(client: openai.OpenAI) -> None:
    """A second of audio is 25 audio tokens however it comes: 16 kHz mono WAV, 44.1 kHz stereo WAV (mixed
    down and resampled), or MP3 (whose encoder pads the clip by a few milliseconds)."""
    at_16k = _prompt_tokens(client, _audio_part(_wav(_waveform(4, 1.0))))
    at_44k = _prompt_tokens(client, _audio_part(_wav(_waveform(4, 1.0, 44100, channels=2), 44100)))
    assert at_44k == at_16k
    mp3 = io.BytesIO()
    soundfile.write(mp3, _waveform(4, 1.0), RATE, format="MP3")
    assert abs(_prompt_tokens(client, _audio_part(mp3.getvalue(), "mp3")) - at_16k) <= 1


SHORT_WAV = _wav(_waveform(5, 0.5))
BAD_CLIPS = {
    "not base64": ({"data": "@@@", "format": "wav"}, "not valid base64"),
    "undecodable": (
        {"data": base64.b64encode(b"RIFF" + bytes(range(200))).decode(), "format": "wav"},
        "cannot be decoded",
    ),
    "truncated": ({"data": base64.b64encode(SHORT_WAV[:30]).decode(), "format": "wav"}, "cannot be decoded"),
    "unsupported format": ({"data": base64.b64encode(SHORT_WAV).decode(), "format": "flac"}, "not supported"),
    "format mismatch": ({"data": base64.b64encode(SHORT_WAV).decode(), "format": "mp3"}, "not mp3"),
    "too long": (
        {"data": base64.b64encode(_wav(_waveform(6, MAX_AUDIO_CLIP_S + 0.5))).decode(), "format": "wav"},
        f"more than the limit of {MAX_AUDIO_CLIP_S} s",
    ),
    "too short": (
        {"data": base64.b64encode(_wav(_waveform(7, 0.01))).decode(), "format": "wav"},
        "too short",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CLIPS))
def test_bad_clips_are_400s(client: openai.OpenAI, case: str) -> None:
    input_audio, message = BAD_CLIPS[case]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[_user("Listen: ", {"type": "input_audio", "input_audio": input_audio})],
            **GREEDY,
        )
    error = caught.value.body
    assert message in error["message"], error
    assert error["param"] == "messages.0.content.1", error
    # The server keeps serving.
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("Hello")], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_more_clips_than_the_limit_is_a_400(client: openai.OpenAI) -> None:
    part = _audio_part(SHORT_WAV)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[_user("One: ", part), {"role": "assistant", "content": "Yes."}, _user("Two: ", part)],
            **GREEDY,
        )
    assert "limit of 1 audio" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.2.content.1"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("One: ", part)], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_an_image_beside_a_clip_is_a_400_naming_the_image(client: openai.OpenAI) -> None:
    """No model here takes both: the audio model refuses the image part of a conversation that has both."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(png, format="PNG")
    url = f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}"
    image = {"type": "image_url", "image_url": {"url": url}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("Hear ", _audio_part(SHORT_WAV), " and see ", image)], **GREEDY
        )
    assert "takes text and audio, not image" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.0.content.3"


def test_a_clip_to_a_text_only_model_is_a_400(api_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("Listen: ", _audio_part(SHORT_WAV))], **GREEDY
        )
    assert "text only, not audio" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.0.content.1"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("Hello")], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS
