"""Audio as a Whisper-style encoder reads it: clips decoded (WAV or MP3, by libsndfile through soundfile),
mixed down to mono and resampled (soxr) to the feature extractor's rate, then turned into log-mel features by
Transformers' WhisperFeatureExtractor, configured by the folder's preprocessor_config.json; and how many
placeholder tokens a clip takes in the prompt (Qwen2-Audio's: after the encoder's strided convolution and
its average pooling)."""

from __future__ import annotations

import io
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import soxr
from kvfleet.runtime.multimodal.inputs import (
    MediaInputError,
    ModalitySpec,
    PreparedItem,
    fixed_shape,
    placeholder_token_id,
)

# The formats of OpenAI's input_audio content parts, and the containers libsndfile reports for each.
AUDIO_FORMATS = {"wav": ("WAV", "WAVEX"), "mp3": ("MP3",)}


@dataclass(frozen=True)
class AudioSettings:
    """What a Qwen2-Audio config.json says about its clips."""

    audio_token_id: int
    num_mel_bins: int
    # The encoder's input window, in mel frames: every clip's features are padded to it.
    num_frames: int

    def num_tokens(self, frames: int) -> int:
        """Embeddings of a clip of `frames` mel frames: the second convolution halves them (stride 2), the
        average pooling halves them again."""
        after_convolution = (frames - 1) // 2 + 1
        return (after_convolution - 2) // 2 + 1

    def modality_spec(self) -> ModalitySpec:
        return ModalitySpec(
            placeholder_id=self.audio_token_id,
            shape_error=fixed_shape((self.num_mel_bins, self.num_frames)),
            num_tokens=lambda _, frames: self.num_tokens(frames),
            max_item_tokens=self.num_tokens(self.num_frames),
        )


def audio_settings(config: dict[str, Any]) -> AudioSettings:
    audio = config["audio_config"]
    # The encoder's position embeddings cover the frames after its stride-2 convolution.
    return AudioSettings(
        audio_token_id=placeholder_token_id(config, "audio"),
        num_mel_bins=int(audio.get("num_mel_bins", 128)),
        num_frames=2 * int(audio.get("max_source_positions", 1500)),
    )


def check_duration(seconds: float, max_seconds: float) -> None:
    if seconds > max_seconds:
        raise MediaInputError(
            f"the audio clip lasts {seconds:.2f} s, more than the limit of {max_seconds:g} s "
            "(max_audio_clip_s)"
        )


def decode_audio(data: bytes, audio_format: str, *, max_seconds: float) -> tuple[np.ndarray, int]:
    """(mono float32 waveform, sampling rate) of the clip in `data`, which must be of `audio_format` (wav or
    mp3); raises MediaInputError for anything else, before decoding a clip that is too long."""
    if audio_format not in AUDIO_FORMATS:
        raise MediaInputError(
            f"audio format {audio_format!r} is not supported; supported: {', '.join(AUDIO_FORMATS)}"
        )
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as clip:
            if clip.format not in AUDIO_FORMATS[audio_format]:
                raise MediaInputError(f"the data is {clip.format} audio, not {audio_format}")
            check_duration(clip.frames / clip.samplerate, max_seconds)
            waveform = clip.read(dtype="float32", always_2d=True)
            rate = clip.samplerate
    except soundfile.LibsndfileError as exc:
        raise MediaInputError(f"the audio cannot be decoded as {audio_format}: {exc.error_string}") from None
    return waveform.mean(axis=1), rate


class AudioProcessor:
    """A clip, (waveform, sampling rate), as the encoder takes it: log-mel features padded to the window,
    and how many of their frames are the clip's."""

    def __init__(self, settings: AudioSettings, extractor: Any, max_seconds: float) -> None:
        self.settings = settings
        self.extractor = extractor
        self.max_seconds = max_seconds

    @classmethod
    def from_folder(
        cls, model_dir: str | Path, settings: AudioSettings, max_seconds: float | None
    ) -> AudioProcessor:
        """max_seconds: the longest clip taken; by default, and at most, the extractor's window."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(
                f"{path} does not exist: an audio model folder needs its feature extractor config"
            )
        from transformers import WhisperFeatureExtractor  # a heavy import, for audio models only

        extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
        if (extractor.feature_size, extractor.nb_max_frames) != (settings.num_mel_bins, settings.num_frames):
            raise ValueError(
                f"{path} gives {extractor.feature_size} mel bins x {extractor.nb_max_frames} frames; "
                f"the encoder takes {settings.num_mel_bins} x {settings.num_frames}"
            )
        window = extractor.n_samples / extractor.sampling_rate
        if max_seconds is not None and max_seconds > window:
            raise ValueError(
                f"max_audio_clip_s ({max_seconds:g}) is longer than the encoder's {window:g} s window"
            )
        return cls(settings, extractor, window if max_seconds is None else max_seconds)

    def __call__(self, clip: Any) -> PreparedItem:
        if not (isinstance(clip, tuple) and len(clip) == 2):
            raise MediaInputError("an audio clip is a (waveform, sampling rate) pair")
        waveform, rate = np.asarray(clip[0], dtype=np.float32), clip[1]
        if waveform.ndim != 1:
            raise MediaInputError(
                f"an audio waveform is mono, one dimension; got shape {list(waveform.shape)}"
            )
        if not isinstance(rate, numbers.Real) or rate <= 0:
            raise MediaInputError(f"the sampling rate must be a positive number, got {rate!r}")
        check_duration(len(waveform) / rate, self.max_seconds)
        target_rate = self.extractor.sampling_rate
        if rate != target_rate:
            waveform = soxr.resample(waveform, rate, target_rate)
        features = self.extractor(
            waveform,
            sampling_rate=target_rate,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="np",
        )
        frames = int(features["attention_mask"][0].sum())
        num_tokens = self.settings.num_tokens(frames)
        if num_tokens < 1:
            raise MediaInputError(f"the audio clip is too short: {frames} mel frames give no audio token")
        return PreparedItem(features["input_features"][0].astype(np.float32), frames, num_tokens)
