"""Images and audio clips of chat content parts. Images: `data:` URLs decoded, http(s) URLs fetched only from
the hosts --allowed-media-domains lists (with a size cap and a timeout); audio: `input_audio` parts, base64
WAV or MP3. All are decoded and preprocessed into the engine's features off the event loop, each checked
against the model and the limits first. Every problem is a 400 naming the content part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.multimodal.audio import decode_audio
from kvfleet.runtime.multimodal.image_processor import decode_image
from kvfleet.runtime.multimodal.inputs import MediaInputError, MultiModalFeature, PreparedItem
from kvfleet.runtime.multimodal.prompt_media import PromptMedia
from kvfleet.runtime.server.openai_errors import BadRequestError
from kvfleet.runtime.server.protocol import ChatMessage, ContentPart

# A fetched image may be this large, and its server this slow, before the request is refused.
MAX_FETCHED_IMAGE_BYTES = 20 << 20
FETCH_TIMEOUT_S = 10.0


@functools.lru_cache(maxsize=4)
def _prompt_media(
    model: str, limits: tuple[tuple[str, int], ...], max_audio_clip_s: float | None
) -> PromptMedia:
    return PromptMedia.for_model(model, dict(limits), max_audio_clip_s)


async def prompt_media(config: EngineConfig) -> PromptMedia:
    """The model's handling of its media, made once (on a thread: it may import Transformers)."""
    limits = tuple(sorted(config.mm_limits().items()))
    return await asyncio.to_thread(_prompt_media, config.model, limits, config.max_audio_clip_s)


# The content part types that carry media, and the modality of each.
_PART_MODALITIES = {"image_url": "image", "input_audio": "audio"}


def media_parts(messages: list[ChatMessage]) -> list[tuple[str, str, ContentPart]]:
    """(param, modality, part) of every image and audio part, in conversation order."""
    found = []
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                if part.type in _PART_MODALITIES:
                    found.append(
                        (f"messages.{index}.content.{part_index}", _PART_MODALITIES[part.type], part)
                    )
    return found


@dataclass(frozen=True)
class ChatMedia:
    """A conversation's items, preprocessed, by modality, and the model's way of placing them."""

    media: PromptMedia
    items: dict[str, list[PreparedItem]]

    async def expand(self, prompt_token_ids: list[int]) -> tuple[list[int], list[MultiModalFeature]]:
        """The rendered prompt with its placeholders expanded, and the items' features."""
        try:
            return await asyncio.to_thread(self.media.place, prompt_token_ids, self.items)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None


async def load_chat_media(config: EngineConfig, messages: list[ChatMessage]) -> ChatMedia | None:
    """The conversation's images and audio clips, checked, decoded and preprocessed; None without any."""
    parts = media_parts(messages)
    if not parts:
        return None
    media = await prompt_media(config)
    counts: dict[str, int] = {}
    for param, modality, _ in parts:  # refuse before decoding anything
        counts[modality] = counts.get(modality, 0) + 1
        try:
            media.check_count(modality, counts[modality])
        except MediaInputError as exc:
            raise BadRequestError(str(exc), param=param) from None
    items: dict[str, list[PreparedItem]] = {}
    for param, modality, part in parts:
        item = await _LOADERS[modality](config, media, param, part)
        items.setdefault(modality, []).append(item)
    return ChatMedia(media, items)


async def _load_image(
    config: EngineConfig, media: PromptMedia, param: str, part: ContentPart
) -> PreparedItem:
    assert part.image_url is not None
    url = part.image_url.url
    data = _data_url_bytes(url, param) if url.startswith("data:") else await _fetch(config, url, param)

    def decode() -> PreparedItem:
        return media.preprocess("image", decode_image(data, max_pixels=config.max_image_pixels))

    return await _in_thread(decode, param)


async def _load_audio(
    config: EngineConfig, media: PromptMedia, param: str, part: ContentPart
) -> PreparedItem:
    assert part.input_audio is not None and media.audio is not None
    audio, max_seconds = part.input_audio, media.audio.max_seconds
    try:
        data = base64.b64decode(audio.data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("the audio data is not valid base64", param=param) from None

    def decode() -> PreparedItem:
        return media.preprocess("audio", decode_audio(data, audio.format, max_seconds=max_seconds))

    return await _in_thread(decode, param)


async def _in_thread(decode: Callable[[], PreparedItem], param: str) -> PreparedItem:
    try:
        return await asyncio.to_thread(decode)
    except MediaInputError as exc:
        raise BadRequestError(str(exc), param=param) from None


_LOADERS: dict[str, Callable[[EngineConfig, PromptMedia, str, ContentPart], Awaitable[PreparedItem]]] = {
    "image": _load_image,
    "audio": _load_audio,
}


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
