"""Images of chat content parts: `data:` URLs decoded, http(s) URLs fetched only from the hosts
--allowed-media-domains lists (with a size cap and a timeout), all decoded by Pillow off the event loop, then
preprocessed into the engine's features. Every problem is a 400 naming the content part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.multimodal.image_processor import ImageInputError, decode_image
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.multimodal.prompt_images import PromptImages
from kvfleet.runtime.server.openai_errors import BadRequestError
from kvfleet.runtime.server.protocol import ChatMessage
from PIL import Image

# A fetched image may be this large, and its server this slow, before the request is refused.
MAX_FETCHED_IMAGE_BYTES = 20 << 20
FETCH_TIMEOUT_S = 10.0


@functools.lru_cache(maxsize=4)
def prompt_images(model: str, max_images: int) -> PromptImages | None:
    return PromptImages.for_model(model, max_images)


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(param, url) of every image part, in conversation order."""
    found = []
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                if part.type == "image_url" and part.image_url is not None:
                    found.append((f"messages.{index}.content.{part_index}", part.image_url.url))
    return found


@dataclass(frozen=True)
class ChatImages:
    """A conversation's images, decoded, and the model's way of preparing them."""

    images_of_model: PromptImages
    images: list[Image.Image]

    async def expand(self, prompt_token_ids: list[int]) -> tuple[list[int], list[MultiModalFeature]]:
        """The rendered prompt with its image placeholders expanded, and the images' features."""
        try:
            return await asyncio.to_thread(self.images_of_model.prepare, prompt_token_ids, self.images)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None


async def load_chat_images(config: EngineConfig, messages: list[ChatMessage]) -> ChatImages | None:
    """The conversation's images, checked and decoded; None without any."""
    urls = image_urls(messages)
    if not urls:
        return None
    images_of_model = prompt_images(config.model, config.mm_limit("image"))
    if images_of_model is None:
        raise BadRequestError("this model takes text only, not images", param=urls[0][0])
    if len(urls) > images_of_model.max_images:
        raise BadRequestError(
            f"the conversation has {len(urls)} images, more than the limit of {images_of_model.max_images} "
            "(--limit-mm-per-prompt)",
            param=urls[images_of_model.max_images][0],
        )
    return ChatImages(images_of_model, [await _load(config, param, url) for param, url in urls])


async def _load(config: EngineConfig, param: str, url: str) -> Image.Image:
    if url.startswith("data:"):
        data = _data_url_bytes(url, param)
    else:
        data = await _fetch(config, url, param)
    try:
        return await asyncio.to_thread(decode_image, data, max_pixels=config.max_image_pixels)
    except ImageInputError as exc:
        raise BadRequestError(str(exc), param=param) from None


def _data_url_bytes(url: str, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    media_type = header.removeprefix("data:").split(";")[0].lower()
    if not comma or not header.endswith(";base64"):
        raise BadRequestError("an image data URL must be base64: data:image/png;base64,...", param=param)
    if not media_type.startswith("image/"):
        raise BadRequestError(
            f"the data URL holds {media_type or 'no media type'}, not an image", param=param
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("the image data URL is not valid base64", param=param) from None


async def _fetch(config: EngineConfig, url: str, param: str) -> bytes:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequestError("an image URL must be a data: URL or an http(s) URL", param=param)
    allowed = config.media_domains()
    if parts.hostname.lower() not in allowed:
        raise BadRequestError(
            f"image URLs from {parts.hostname!r} are not allowed (--allowed-media-domains)", param=param
        )
    try:
        async with (
            httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise BadRequestError(f"fetching the image gave HTTP {response.status_code}", param=param)
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_FETCHED_IMAGE_BYTES:
                    raise BadRequestError(
                        f"the image at the URL is larger than {MAX_FETCHED_IMAGE_BYTES} bytes", param=param
                    )
            return bytes(data)
    except httpx.HTTPError as exc:
        raise BadRequestError(
            f"the image URL could not be fetched: {type(exc).__name__}", param=param
        ) from None
