"""The front end's half of image input: a prompt's images preprocessed for the model and its image
placeholders expanded, ready for the engine (which never decodes or resizes anything)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvfleet.runtime.multimodal.image_processor import (
    ImageInputError,
    ImageProcessor,
    VisionSettings,
    vision_settings,
)
from kvfleet.runtime.multimodal.inputs import MultiModalFeature, expand_placeholders
from PIL import Image


class PromptImages:
    def __init__(self, settings: VisionSettings, processor: ImageProcessor, max_images: int) -> None:
        self.settings = settings
        self.processor = processor
        self.max_images = max_images

    @classmethod
    def for_model(cls, model_dir: str | Path, max_images: int) -> PromptImages | None:
        """The model folder's image handling; None for a text-only model."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if "vision_config" not in config:
            return None
        return cls(vision_settings(config), ImageProcessor.from_folder(model_dir), max_images)

    def prepare(
        self, prompt_token_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each image placeholder token expanded to the image's embeddings, and the images'
        features. Raises ImageInputError for too many images, ValueError when placeholders and images do not
        pair up."""
        if len(images) > self.max_images:
            raise ImageInputError(
                f"the prompt has {len(images)} images, more than the limit of {self.max_images} "
                "(limit_mm_per_prompt)"
            )
        arrays = [self.processor(image.convert("RGB")) for image in images]
        settings = self.settings
        return expand_placeholders(
            prompt_token_ids, settings.image_token_id, settings.tokens_per_image, arrays, "image"
        )
