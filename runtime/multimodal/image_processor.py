"""Images as a vision model reads them: decoding (Pillow), and the resize, centre crop and normalisation that
the folder's preprocessor_config.json describes, with the meaning Transformers' CLIP image processor gives
those settings; and how many placeholder tokens each image takes in the prompt."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvfleet.runtime.multimodal.inputs import MediaInputError, ModalitySpec, fixed_shape, placeholder_token_id
from PIL import Image, UnidentifiedImageError

# No image may be longer than this many times its width (or the reverse), as Qwen2-VL's image processor
# rules: resizing a thin image's short side up to a model's size multiplies its pixels by as much.
MAX_ASPECT_RATIO = 200
# An image whose resized whole would hold more than this many times the pixels its centre crop keeps is
# cropped before it is resized (only the kept part resampled). Smaller ones are resized whole, as
# Transformers does: Pillow picks the order of its two passes from the sizes, so resizing only a part may
# round some noisy pixels differently.
_MAX_RESIZED_PER_KEPT = 4
# What Pillow may decode: the formats content parts take (PNG, JPEG, WebP), nothing else it can read.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class VisionSettings:
    """What a LLaVA config.json says about its images."""

    image_token_id: int
    # The vision layers that run: LLaVA reads this layer's output (hidden_states[feature_layer] in CLIP).
    feature_layer: int
    # `full` keeps CLIP's class token among an image's embeddings, `default` drops it.
    keep_class_token: bool
    tokens_per_image: int
    image_size: int

    def modality_spec(self) -> ModalitySpec:
        tokens = self.tokens_per_image
        return ModalitySpec(
            placeholder_id=self.image_token_id,
            shape_error=fixed_shape((3, self.image_size, self.image_size)),
            num_tokens=lambda _shape, _length: tokens,
            max_item_tokens=tokens,
        )


@dataclass(frozen=True)
class GridVisionSettings:
    """What a Qwen2.5-Omni config.json and its preprocessor_config.json say about images: each resized to
    multiples of patch_size x merge_size, within [min_pixels, max_pixels] and close to its aspect ratio, cut
    into patches, and each merge_size x merge_size patches merged into one embedding (so an image's
    embeddings form a grid, which M-RoPE positions by row and column)."""

    image_token_id: int
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid(self, shape: Sequence[int]) -> tuple[int, int]:
        """Rows and columns of the embeddings of an image of shape [3, height, width]."""
        return shape[1] // self.factor, shape[2] // self.factor

    def shape_error(self, shape: Sequence[int]) -> str | None:
        if len(shape) != 3 or shape[0] != 3 or shape[1] % self.factor or shape[2] % self.factor:
            return f"the model takes [3, height, width], each side a multiple of {self.factor}"
        if not self.min_pixels <= shape[1] * shape[2] <= self.max_pixels:
            return f"the model takes {self.min_pixels} to {self.max_pixels} pixels"
        return None

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image is resized to, as Qwen2-VL's image processor rounds them."""
        factor = self.factor
        new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
        if new_height * new_width > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            new_height = max(factor, math.floor(height / scale / factor) * factor)
            new_width = max(factor, math.floor(width / scale / factor) * factor)
        elif new_height * new_width < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            new_height = math.ceil(height * scale / factor) * factor
            new_width = math.ceil(width * scale / factor) * factor
        return new_width, new_height

    def modality_spec(self) -> ModalitySpec:
        return ModalitySpec(
            placeholder_id=self.image_token_id,
            shape_error=self.shape_error,
            num_tokens=lambda shape, _: math.prod(self.grid(shape)),
            max_item_tokens=self.max_pixels // self.factor**2,
            mrope_grid=self.grid,
        )


def grid_vision_settings(config: dict[str, Any], model_dir: str | Path) -> GridVisionSettings:
    vision = config["vision_config"]
    processor = _image_processor_config(model_dir)
    size = processor.get("size") or {}
    return GridVisionSettings(
        image_token_id=placeholder_token_id(config, "image"),
        patch_size=int(vision.get("patch_size", 14)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
    )


def _image_processor_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: a vision model folder needs its image processor config")
    return json.loads(path.read_text())


def vision_settings(config: dict[str, Any]) -> VisionSettings:
    vision = config["vision_config"]
    num_layers = int(vision["num_hidden_layers"])
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or not -num_layers - 1 <= layer <= num_layers:
        raise ValueError(f"vision_feature_layer {layer!r} is not supported (one layer index)")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not default or full")
    num_patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    return VisionSettings(
        image_token_id=placeholder_token_id(config, "image"),
        feature_layer=layer if layer >= 0 else num_layers + 1 + layer,
        keep_class_token=strategy == "full",
        tokens_per_image=num_patches + (strategy == "full"),
        image_size=int(vision["image_size"]),
    )


def check_aspect_ratio(width: int, height: int) -> None:
    """Raises MediaInputError for an image longer than MAX_ASPECT_RATIO times its width, or the reverse."""
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise MediaInputError(
            f"the image is {width}x{height}: its aspect ratio is more than the limit of {MAX_ASPECT_RATIO}"
        )


def data_url_bytes(url: str) -> bytes:
    """The bytes of an image's base64 `data:` URL; raises MediaInputError for any other data URL."""
    header, comma, payload = url.partition(",")
    media_type = header.removeprefix("data:").split(";")[0].lower()
    if not comma or not header.endswith(";base64"):
        raise MediaInputError("an image data URL must be base64: data:image/png;base64,...")
    if not media_type.startswith("image/"):
        raise MediaInputError(f"the data URL holds {media_type or 'no media type'}, not an image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaInputError("the image data URL is not valid base64") from None


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """The RGB image in `data`; raises MediaInputError for anything else, before decoding one too large or
    too thin."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise MediaInputError(f"the image is not a {', '.join(IMAGE_FORMATS)} image") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaInputError(f"the image cannot be decoded: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise MediaInputError(f"the image has {width}x{height} pixels, more than the limit of {max_pixels}")
    check_aspect_ratio(width, height)
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaInputError(f"the image cannot be decoded: {exc}") from None
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    """preprocessor_config.json's CLIP-style steps: resize (shortest edge, or height and width), centre crop,
    rescale, normalise; channels first, float32."""

    resize: dict[str, int] | None
    resample: int
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: np.ndarray | None
    std: np.ndarray | None

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> ImageProcessor:
        raw = _image_processor_config(model_dir)
        crop = raw.get("crop_size") if raw.get("do_center_crop", True) else None
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        size = raw.get("size") if raw.get("do_resize", True) else None
        if isinstance(size, int):
            size = {"shortest_edge": size}
        normalize = raw.get("do_normalize", True)
        return cls(
            resize=size,
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
            crop=None if crop is None else (int(crop["height"]), int(crop["width"])),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
            mean=np.asarray(raw["image_mean"], dtype=np.float32).reshape(-1, 1, 1) if normalize else None,
            std=np.asarray(raw["image_std"], dtype=np.float32).reshape(-1, 1, 1) if normalize else None,
        )

    def output_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """The shape [3, H, W] of what an image of this size becomes, known before any pixel is touched."""
        if self.resize is not None:
            width, height = self._resized_size(width, height)
        if self.crop is not None:
            height, width = self.crop
        return 3, height, width

    def __call__(self, image: Image.Image) -> np.ndarray:  # -> [3, H, W] float32
        if self.resize is not None:
            image = self._resized(image)
        pixels = np.asarray(image).transpose(2, 0, 1)
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        values = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            values = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            values = (values - self.mean) / self.std
        return np.ascontiguousarray(values, dtype=np.float32)

    def _resized(self, image: Image.Image) -> Image.Image:
        """The image resized; when a crop follows that keeps a small part of it, only that part."""
        width, height = self._resized_size(*image.size)
        if self.crop is None or width * height <= _MAX_RESIZED_PER_KEPT * math.prod(self.crop):
            return image.resize((width, height), resample=self.resample)
        (top, bottom), (left, right) = (
            _kept_span(height, self.crop[0]),
            _kept_span(width, self.crop[1]),
        )
        scale_x, scale_y = image.width / width, image.height / height
        box = (left * scale_x, top * scale_y, right * scale_x, bottom * scale_y)
        return image.resize((right - left, bottom - top), resample=self.resample, box=box)

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        size = self.resize
        assert size is not None
        if "shortest_edge" in size:
            short, long = sorted((width, height))
            new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
            return (new_short, new_long) if width <= height else (new_long, new_short)
        return int(size["width"]), int(size["height"])


def _kept_span(resized: int, crop: int) -> tuple[int, int]:
    """[start, end) of a side of `resized` pixels that its centre crop to `crop` keeps."""
    start = max(0, (resized - crop) // 2)
    return start, min(resized, start + crop)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre height x width of a [C, H, W] array, zero-padded where the image is smaller."""
    channels, image_height, image_width = pixels.shape
    out = np.zeros((channels, max(height, image_height), max(width, image_width)), dtype=pixels.dtype)
    top_pad, left_pad = (out.shape[1] - image_height) // 2, (out.shape[2] - image_width) // 2
    out[:, top_pad : top_pad + image_height, left_pad : left_pad + image_width] = pixels
    top, left = (out.shape[1] - height) // 2, (out.shape[2] - width) // 2
    return out[:, top : top + height, left : left + width]
