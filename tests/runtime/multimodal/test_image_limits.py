"""What an image may cost before it is preprocessed: a thin image is refused before it is decoded or resized,
one that would become pixels of a shape the model does not take is refused before it is resized, and a crop
that keeps a small part of a large resize resamples only that part, so the peak memory of preprocessing an
image stays near that of its own pixels and the model's input (measured as the process's peak RSS)."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kvfleet.runtime.multimodal.image_processor import MAX_ASPECT_RATIO, ImageProcessor, decode_image
from kvfleet.runtime.multimodal.inputs import MediaInputError
from kvfleet.runtime.multimodal.prompt_media import PromptMedia
from memory import proc_status_kb, reset_peak_rss
from PIL import Image

# LLaVA 1.5's CLIP steps: shortest edge to 336, centre crop of 336 x 336.
LLAVA_15_SIDE = 336
# Preprocessing the thinnest image allowed, resized whole first, would hold a 336 x 67200 image and two
# copies of it (some 200 MiB); cropped first, a few MiB.
PEAK_ALLOWANCE_KB = 24 * 1024


@pytest.fixture(scope="module")
def llava(make_model: Callable[..., Path]) -> Path:
    return make_model("llava", "tiny")


def _png(height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 200, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _gradient(height: int, width: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    channels = [x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)]
    return Image.fromarray(np.stack(channels, axis=-1).astype(np.uint8))


@pytest.fixture
def peak_rss_growth_kb() -> Iterator[Callable[[], int]]:
    """A function giving how far this process's peak RSS has risen since the fixture began."""
    baseline_kb = reset_peak_rss("self")
    yield lambda: proc_status_kb("self", "VmHWM") - baseline_kb


def test_a_thin_image_is_refused_before_it_is_decoded() -> None:
    with pytest.raises(MediaInputError, match="1x40000: its aspect ratio is more than the limit of 200"):
        decode_image(_png(40000, 1), max_pixels=1 << 24)
    assert decode_image(_png(MAX_ASPECT_RATIO, 1), max_pixels=1 << 24).size == (1, MAX_ASPECT_RATIO)


def test_a_thin_image_is_refused_before_it_is_resized(llava: Path) -> None:
    media = PromptMedia.for_model(llava, {"image": 1}, None)
    with pytest.raises(MediaInputError, match="aspect ratio is more than the limit of 200"):
        media.preprocess("image", _gradient(1, MAX_ASPECT_RATIO + 1))
    assert media.preprocess("image", _gradient(1, MAX_ASPECT_RATIO)).data.shape == (3, 30, 30)


def test_a_shape_the_model_does_not_take_is_refused_before_resizing(llava: Path, tmp_path: Path) -> None:
    """Without the centre crop, LLaVA's shortest-edge resize would give pixels of the image's own aspect
    ratio, which the model (30 x 30 only) does not take: refused before they are made."""
    uncropped = tmp_path / "uncropped"
    shutil.copytree(llava, uncropped)
    config_path = uncropped / "preprocessor_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "do_center_crop": False}))
    media = PromptMedia.for_model(uncropped, {"image": 1}, None)
    with pytest.raises(MediaInputError, match=r"\(60x40\) would become \[3, 30, 45\]: the model takes"):
        media.preprocess("image", _gradient(40, 60))
    assert media.preprocess("image", _gradient(40, 40)).data.shape == (3, 30, 30)


def _llava_15_processor(tmp_path: Path) -> ImageProcessor:
    config = {
        "do_resize": True,
        "size": {"shortest_edge": LLAVA_15_SIDE},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": LLAVA_15_SIDE, "width": LLAVA_15_SIDE},
        "do_normalize": False,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    return ImageProcessor.from_folder(tmp_path)


def test_the_thinnest_image_is_cropped_before_it_is_resized(
    tmp_path: Path, peak_rss_growth_kb: Callable[[], int]
) -> None:
    processor = _llava_15_processor(tmp_path)
    thin = _gradient(1, MAX_ASPECT_RATIO)
    pixels = processor(thin)
    growth_kb = peak_rss_growth_kb()
    assert pixels.shape == (3, LLAVA_15_SIDE, LLAVA_15_SIDE)
    assert growth_kb < PEAK_ALLOWANCE_KB, f"preprocessing one image raised the peak RSS by {growth_kb} kB"
    # The same pixels as resizing the whole image and cropping its centre (a smooth image: Pillow rounds
    # noisy pixels a little differently when it resamples only a part).
    resized = np.asarray(thin.resize((LLAVA_15_SIDE * MAX_ASPECT_RATIO, LLAVA_15_SIDE), resample=3))
    left = (resized.shape[1] - LLAVA_15_SIDE) // 2
    whole = resized[:, left : left + LLAVA_15_SIDE].transpose(2, 0, 1) / 255
    np.testing.assert_allclose(pixels, whole, atol=1.5 / 255)
