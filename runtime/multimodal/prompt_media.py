"""The front end's half of multimodal input: a prompt's items checked against the model and the limits,
preprocessed for the model (images resized and normalised, audio clips turned into log-mel features), and
their placeholders expanded, ready for the engine (which never decodes, resizes or resamples anything)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from kvfleet.runtime.hf_config import read_hf_config
from kvfleet.runtime.multimodal.image_processor import (
    GridVisionSettings,
    ImageProcessor,
    check_aspect_ratio,
    grid_vision_settings,
    vision_settings,
)
from kvfleet.runtime.multimodal.inputs import (
    MediaInputError,
    ModalitySpec,
    MultiModalFeature,
    PreparedItem,
    expand_placeholders,
    modality_refusal,
)

if TYPE_CHECKING:
    from kvfleet.runtime.multimodal.audio import AudioProcessor


def modality_specs(config: dict[str, Any], model_dir: str | Path) -> dict[str, ModalitySpec]:
    """What a model's config.json (and for images laid out on a grid, its preprocessor_config.json) says it
    takes besides text: empty for a text-only model."""
    specs = {}
    if "vision_config" in config:
        specs["image"] = (
            grid_vision_settings(config, model_dir).modality_spec()
            if uses_image_grid(config)
            else vision_settings(config).modality_spec()
        )
    if "audio_config" in config:
        # Audio's decoders load only for a model that takes audio (a router preparing images needs none).
        from kvfleet.runtime.multimodal.audio import audio_settings

        specs["audio"] = audio_settings(config).modality_spec()
    return specs


class PromptMedia:
    def __init__(
        self,
        specs: dict[str, ModalitySpec],
        preprocessors: dict[str, Callable[[Any], PreparedItem]],
        limits: dict[str, int],
        audio: AudioProcessor | None,
    ) -> None:
        self.specs = specs
        self.preprocessors = preprocessors
        self.limits = limits
        # The model's audio handling (its clip length limit included); None when it takes no audio.
        self.audio = audio

    @classmethod
    def for_model(
        cls,
        model_dir: str | Path,
        limits: Mapping[str, int],
        max_audio_clip_s: float | None,
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> PromptMedia:
        """The model folder's handling of each modality it takes (its config.json after vLLM's hf_overrides),
        under the limits (limit_mm_per_prompt's counts, max_audio_clip_s)."""
        model_dir = Path(model_dir)
        model_config = read_hf_config(model_dir, hf_overrides)
        specs = modality_specs(model_config, model_dir)
        preprocessors: dict[str, Callable[[Any], PreparedItem]] = {}
        audio = None
        if "image" in specs:
            image_processor = ImageProcessor.from_folder(model_dir)
            preprocessors["image"] = (
                _grid_image_preprocessor(
                    image_processor, grid_vision_settings(model_config, model_dir), specs["image"]
                )
                if uses_image_grid(model_config)
                else _image_preprocessor(image_processor, specs["image"])
            )
        if "audio" in specs:
            from kvfleet.runtime.multimodal.audio import AudioProcessor, audio_settings

            audio = AudioProcessor.from_folder(model_dir, audio_settings(model_config), max_audio_clip_s)
            preprocessors["audio"] = audio
        return cls(specs, preprocessors, {modality: limits[modality] for modality in specs}, audio)

    def check_count(self, modality: str, count: int) -> None:
        """Raises MediaInputError unless the model takes `count` items of `modality` in one prompt."""
        if modality not in self.specs:
            raise MediaInputError(modality_refusal(modality, self.specs))
        if count > self.limits[modality]:
            raise MediaInputError(
                f"more than the limit of {self.limits[modality]} {modality} items per prompt "
                "(limit_mm_per_prompt)"
            )

    def preprocess(self, modality: str, item: Any) -> PreparedItem:
        """One item as its encoder takes it; raises MediaInputError for one the model cannot take."""
        return self.preprocessors[modality](item)

    def place(
        self, prompt_token_ids: Sequence[int], items: Mapping[str, Sequence[PreparedItem]]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each placeholder token expanded to its item's embeddings, and the items' features.
        Raises ValueError when placeholders and items do not pair up."""
        return expand_placeholders(prompt_token_ids, items, self.specs)

    def prepare(
        self, prompt_token_ids: Sequence[int], items: Mapping[str, Sequence[Any]]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """check_count, preprocess and place for a prompt's items (by modality, in prompt order)."""
        items = {modality: values for modality, values in items.items() if values}
        for modality, values in items.items():
            self.check_count(modality, len(values))
        prepared = {
            modality: [self.preprocess(modality, value) for value in values]
            for modality, values in items.items()
        }
        return self.place(prompt_token_ids, prepared)


def _image_preprocessor(processor: ImageProcessor, spec: ModalitySpec) -> Callable[[Any], PreparedItem]:
    tokens = spec.max_item_tokens

    def preprocess(image: Any) -> PreparedItem:
        pixels = _checked_pixels(processor, spec, image.convert("RGB"))
        return PreparedItem(pixels, pixels.shape[-1], tokens)

    return preprocess


def _checked_pixels(processor: ImageProcessor, spec: ModalitySpec, image: Any) -> np.ndarray:
    """The image through the processor, refused before any resizing when it is too thin or would become
    pixels of a shape the model does not take: so that no image costs more memory than its own pixels and
    the model's input."""
    check_aspect_ratio(*image.size)
    shape = processor.output_shape(*image.size)
    problem = spec.shape_error(shape)
    if problem is not None:
        raise MediaInputError(
            f"the image ({image.width}x{image.height}) would become {list(shape)}: {problem}"
        )
    return processor(image)


def uses_image_grid(config: dict[str, Any]) -> bool:
    """Whether the model's images are resized to their own grid of merged patches (Qwen2.5-Omni's), rather
    than to one size (LLaVA's)."""
    return "spatial_merge_size" in config["vision_config"]


def _grid_image_preprocessor(
    processor: ImageProcessor, settings: GridVisionSettings, spec: ModalitySpec
) -> Callable[[Any], PreparedItem]:
    def preprocess(image: Any) -> PreparedItem:
        image = image.convert("RGB")
        width, height = settings.resized_size(*image.size)
        resizing = replace(processor, resize={"width": width, "height": height}, crop=None)
        pixels = _checked_pixels(resizing, spec, image)
        return PreparedItem(pixels, pixels.shape[-1], spec.num_tokens(pixels.shape, pixels.shape[-1]))

    return preprocess
