"""Images and audio clips of chat content parts. Images: `data:` URLs decoded, http(s) URLs fetched only from
the origins --allowed-media-domains lists and the addresses media_sources allows (with a size cap and one
deadline for the whole fetch), file: URLs read only inside --allowed-local-media-path; audio: `input_audio`
parts, base64
WAV or MP3. All are decoded and preprocessed into the engine's features off the event loop, each checked
against the model and the limits first. Every problem is a 400 naming the content part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import json
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

import httpx
from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.multimodal.audio import decode_audio
from kvfleet.runtime.multimodal.image_processor import data_url_bytes, decode_image
from kvfleet.runtime.multimodal.inputs import MediaInputError, MultiModalFeature, PreparedItem
from kvfleet.runtime.multimodal.media_sources import DEFAULT_PORTS, IPAddress, IPNetwork, address_allowed
from kvfleet.runtime.multimodal.prompt_media import PromptMedia
from kvfleet.runtime.serving.protocol import ChatMessage, ContentPart, media_parts

# A fetched image may be this large before the request is refused.
MAX_FETCHED_MEDIA_BYTES = 20 << 20


@functools.lru_cache(maxsize=4)
def _prompt_media(
    model: str, limits: tuple[tuple[str, int], ...], max_audio_clip_s: float | None, hf_overrides_json: str
) -> PromptMedia:
    return PromptMedia.for_model(model, dict(limits), max_audio_clip_s, json.loads(hf_overrides_json))


async def prompt_media(config: EngineConfig) -> PromptMedia:
    """The model's handling of its media, made once (on a thread: it may import Transformers)."""
    limits = tuple(sorted(config.mm_limits().items()))
    # The overrides as JSON text, which the cache can key on.
    overrides = json.dumps(config.hf_overrides, sort_keys=True)
    return await asyncio.to_thread(_prompt_media, config.model, limits, config.max_audio_clip_s, overrides)


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
    if url.startswith("data:"):
        data = _data_url_bytes(url, param)
    elif url.startswith("file:"):
        data = await asyncio.to_thread(_read_local, config, url, param)
    else:
        data = await _fetch(config, url, param)

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
    try:
        return data_url_bytes(url)
    except MediaInputError as exc:
        raise BadRequestError(str(exc), param=param) from None


def _read_local(config: EngineConfig, url: str, param: str) -> bytes:
    """The file a file: URL names, inside allowed_local_media_path once every link is resolved (one that
    leads out of it is refused), of MAX_FETCHED_MEDIA_BYTES at most."""
    if config.allowed_local_media_path is None:
        raise BadRequestError("file: image URLs are not allowed (--allowed-local-media-path)", param=param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise BadRequestError("a file: image URL names a path on this host: file:///PATH", param=param)
    folder = Path(config.allowed_local_media_path).resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(folder):
        raise BadRequestError(
            "the image file is not inside the folder --allowed-local-media-path allows", param=param
        )
    try:
        # Not blocking: a pipe's open would wait for a writer.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise BadRequestError(f"the image file cannot be read: {exc.strerror}", param=param) from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise BadRequestError("the image URL names something other than a file", param=param)
        with open(descriptor, "rb", closefd=False) as file:
            data = file.read(MAX_FETCHED_MEDIA_BYTES + 1)
    finally:
        os.close(descriptor)
    if len(data) > MAX_FETCHED_MEDIA_BYTES:
        raise BadRequestError(f"the image file is larger than {MAX_FETCHED_MEDIA_BYTES} bytes", param=param)
    return data


async def _fetch(config: EngineConfig, url: str, param: str) -> bytes:
    """The body at an http(s) URL of an allowed origin, from an allowed address: fetched within
    media_fetch_timeout in all (name lookup, connection, headers and body), of MAX_FETCHED_MEDIA_BYTES at
    most."""
    parts = urlsplit(url)
    origin = _origin(parts)
    if origin is None:
        raise BadRequestError("an image URL must be a data:, http(s) or file: URL", param=param)
    scheme, host, port = origin
    if not any(allowed.allows(scheme, host, port) for allowed in config.media_origins()):
        raise BadRequestError(
            f"image URLs from {scheme}://{host}:{port} are not allowed (--allowed-media-domains)", param=param
        )
    deadline_s = config.media_fetch_timeout
    try:
        async with asyncio.timeout(deadline_s):
            address = await _allowed_address(host, port, config.media_networks())
            return await _get(parts, address, port, deadline_s)
    except TimeoutError:
        raise BadRequestError(
            f"fetching the image URL took more than {deadline_s:g} s (--media-fetch-timeout)", param=param
        ) from None
    except MediaInputError as exc:
        raise BadRequestError(str(exc), param=param) from None
    except httpx.HTTPError as exc:
        raise BadRequestError(
            f"the image URL could not be fetched: {type(exc).__name__}", param=param
        ) from None


def _origin(parts: SplitResult) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the port the scheme's default where it names none; None for
    any other URL."""
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        return None
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname, DEFAULT_PORTS[scheme] if port is None else port


async def _allowed_address(host: str, port: int, networks: tuple[IPNetwork, ...]) -> IPAddress:
    """The address to fetch from: the host's, when every address it resolves to is allowed (one that is
    not would otherwise be reachable whenever the lookup answers it)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise MediaInputError(f"the image URL's host {host!r} does not resolve") from None
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    for address in addresses:
        if not address_allowed(address, networks):
            raise MediaInputError(
                f"the image URL's host {host!r} resolves to {address}, not a public address "
                "(--allowed-media-networks)"
            )
    return addresses[0]


async def _get(parts: SplitResult, address: IPAddress, port: int, timeout_s: float) -> bytes:
    """GET the URL from the address checked (not from a second lookup, which could answer another), with
    the URL's host in the Host header and TLS checked against it; the body unencoded, so that what is
    counted is what is kept."""
    literal = f"[{address}]" if address.version == 6 else str(address)
    pinned = urlunsplit(parts._replace(netloc=f"{literal}:{port}"))
    headers = {"Host": parts.netloc.rpartition("@")[2], "Accept-Encoding": "identity"}
    async with (
        httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False) as client,
        client.stream(
            "GET", pinned, headers=headers, extensions={"sni_hostname": parts.hostname}
        ) as response,
    ):
        if response.status_code != 200:
            raise MediaInputError(f"fetching the image gave HTTP {response.status_code}")
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        if encoding != "identity":
            raise MediaInputError(f"the image came {encoding}-encoded; it is fetched unencoded only")
        too_large = MediaInputError(f"the image at the URL is larger than {MAX_FETCHED_MEDIA_BYTES} bytes")
        if int(response.headers.get("Content-Length") or 0) > MAX_FETCHED_MEDIA_BYTES:
            raise too_large
        data = bytearray()
        async for chunk in response.aiter_raw():
            data += chunk
            if len(data) > MAX_FETCHED_MEDIA_BYTES:
                raise too_large
        return bytes(data)
