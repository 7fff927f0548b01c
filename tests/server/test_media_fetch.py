"""Which image URLs the API server fetches, through its media loader against HTTP servers on loopback: only
from an allowed origin (scheme, host and port), only from addresses that are public or allowed by network,
and only bodies it can count as they stream (unencoded, within the byte cap); and which file: URLs it
reads."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kvfleet.contract.errors import BadRequestError
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.multimodal.media_sources import MediaOrigin
from kvfleet.runtime.serving.media import MAX_FETCHED_MEDIA_BYTES, load_chat_media
from kvfleet.runtime.serving.protocol import ChatMessage
from local_http import QuietHandler, serving
from PIL import Image

CHUNK = b"\0" * (1 << 16)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((20, 20, 3), 90, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def llava(make_model: Callable[..., Path]) -> Path:
    return make_model("llava", "tiny")


@pytest.fixture(scope="module")
def media_host() -> Iterator[int]:
    """The port of an HTTP server on 127.0.0.1: a PNG at /cat.png, a gzip-encoded one at /cat.png.gz and a
    body that never ends at /endless."""
    png = _png()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            if self.path == "/cat.png.gz":
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(png)
            elif self.path == "/cat.png.gz":
                self.wfile.write(gzip.compress(png))
            elif self.path == "/endless":
                while True:
                    self.wfile.write(CHUNK)

    with serving(Handler) as port:
        yield port


def _load(config: EngineConfig, url: str) -> list[int]:
    """The shape of the one image of a user turn that holds `url`."""
    message = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": url}}])
    chat_media = asyncio.run(load_chat_media(config, [message]))
    assert chat_media is not None
    return list(chat_media.items["image"][0].data.shape)


def _refusal(config: EngineConfig, url: str) -> str:
    with pytest.raises(BadRequestError) as caught:
        _load(config, url)
    assert caught.value.param == "messages.0.content.0"
    return caught.value.message


def test_origins_match_scheme_host_and_port() -> None:
    assert MediaOrigin.parse("Images.Example.com").allows("https", "images.example.com", 443)
    assert MediaOrigin.parse("images.example.com").allows("http", "images.example.com", 80)
    assert not MediaOrigin.parse("images.example.com").allows("http", "images.example.com", 8080)
    assert MediaOrigin.parse("images.example.com:8080").allows("http", "images.example.com", 8080)
    assert not MediaOrigin.parse("https://images.example.com").allows("http", "images.example.com", 443)
    assert MediaOrigin.parse("[::1]:81").allows("http", "::1", 81)
    for entry in ("ftp://images.example.com", "images.example.com/cats", "user@images.example.com", "h:x"):
        with pytest.raises(ValueError, match="is not host, host:port or http"):
            MediaOrigin.parse(entry)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_an_allowed_name_of_a_loopback_address_is_refused(llava: Path, media_host: int, host: str) -> None:
    """The origin is allowed, but its address is the server's own loopback: refused unless its network is
    allowed too, as it is for the normal fetch beside it."""
    refusing = EngineConfig(model=str(llava), allowed_media_domains=f"{host}:{media_host}")
    message = _refusal(refusing, f"http://{host}:{media_host}/cat.png")
    assert "not a public address (--allowed-media-networks)" in message
    allowing = refusing.replace(
        allowed_media_domains=f"127.0.0.1:{media_host}", allowed_media_networks="127.0.0.0/8"
    )
    assert _load(allowing, f"http://127.0.0.1:{media_host}/cat.png") == [3, 30, 30]


@pytest.fixture
def loopback_config(llava: Path, media_host: int) -> EngineConfig:
    return EngineConfig(
        model=str(llava),
        allowed_media_domains=f"127.0.0.1:{media_host}",
        allowed_media_networks="127.0.0.1",
    )


def test_an_encoded_body_is_refused_rather_than_inflated(
    loopback_config: EngineConfig, media_host: int
) -> None:
    message = _refusal(loopback_config, f"http://127.0.0.1:{media_host}/cat.png.gz")
    assert "gzip-encoded" in message


def test_an_endless_body_is_cut_at_the_cap(loopback_config: EngineConfig, media_host: int) -> None:
    message = _refusal(loopback_config, f"http://127.0.0.1:{media_host}/endless")
    assert f"larger than {MAX_FETCHED_MEDIA_BYTES} bytes" in message
    assert _load(loopback_config, f"http://127.0.0.1:{media_host}/cat.png") == [3, 30, 30]


def test_file_urls_are_read_only_inside_the_allowed_folder(llava: Path, tmp_path: Path) -> None:
    """vLLM's --allowed-local-media-path: file:// URLs of files in the folder (its subfolders too) are read
    as the same bytes sent in a data: URL would be; a path out of it, by .. or through a link, a pipe, a
    missing file, another host's path and any file: URL without the option are refused."""
    folder, outside = tmp_path / "media", tmp_path / "secret.png"
    (folder / "cats").mkdir(parents=True)
    (folder / "cats" / "cat.png").write_bytes(_png())
    outside.write_bytes(_png())
    (folder / "link.png").symlink_to(outside)
    os.mkfifo(folder / "pipe.png")
    config = EngineConfig(model=str(llava), allowed_local_media_path=str(folder))
    data_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    sent = _pixels(config, data_url)
    assert np.array_equal(_pixels(config, (folder / "cats" / "cat.png").as_uri()), sent)
    assert np.array_equal(_pixels(config, f"file://localhost{folder}/cats/cat%2Epng"), sent)
    refused = {
        f"file://{folder}/../secret.png": "not inside the folder --allowed-local-media-path allows",
        (folder / "link.png").as_uri(): "not inside the folder",
        (folder / "pipe.png").as_uri(): "names something other than a file",
        (folder / "cats").as_uri(): "names something other than a file",
        (folder / "dog.png").as_uri(): "cannot be read: No such file or directory",
        f"file://elsewhere{folder}/cats/cat.png": "names a path on this host",
    }
    for url, words in refused.items():
        assert words in _refusal(config, url), url
    unset = config.replace(allowed_local_media_path=None)
    assert "file: image URLs are not allowed" in _refusal(unset, (folder / "cats" / "cat.png").as_uri())
    with pytest.raises(ValueError, match=r"allowed_local_media_path .* is not a folder"):
        config.replace(allowed_local_media_path=str(outside))


def _pixels(config: EngineConfig, url: str) -> np.ndarray:
    message = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": url}}])
    chat_media = asyncio.run(load_chat_media(config, [message]))
    assert chat_media is not None
    return chat_media.items["image"][0].data
