"""Images in chat requests, through the official openai SDK against a real server of a tiny LLaVA: answers
equal to Transformers' greedy ones, the encoder cache by the server's metrics, images fetched from an
allowed origin and address only and within one deadline, and a clear 400 for each kind of bad image (a thin
one before it costs memory), after which the server keeps serving."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import openai
import pytest
from local_http import QuietHandler, serving
from memory import proc_status_kb, reset_peak_rss
from PIL import Image
from server_checks import encoder_runs, transformers_chat_answer
from transformers import LlavaForConditionalGeneration

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
MAX_TOKENS = 6
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
MAX_IMAGE_PIXELS = 200 * 200
# The whole fetch of an image URL, and what a slow host gets past it on a loaded machine.
FETCH_TIMEOUT_S = 3
FETCH_MARGIN_S = 5
DRIP_SECONDS = 30


def _image(seed: int, height: int = 36, width: int = 44) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def _encoded(image: Image.Image, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _user(*parts: dict[str, Any] | str) -> dict[str, Any]:
    content = [{"type": "text", "text": part} if isinstance(part, str) else part for part in parts]
    return {"role": "user", "content": content}


@pytest.fixture(scope="module")
def llava(make_model: Callable[..., Path]) -> Path:
    return make_model("llava", "tiny")


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An HTTP server on loopback that serves one PNG at /cat.png, and at /drip the start of one at a byte a
    second for DRIP_SECONDS (each read well within any per-read timeout)."""
    body = _encoded(_image(7))

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path in ("/cat.png", "/drip") else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)
            elif self.path == "/drip":
                for byte in body[:DRIP_SECONDS]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(1)

    with serving(Handler) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def llava_server(start_server: Callable[..., ServerProcess], llava: Path, image_host: str) -> ServerProcess:
    return start_server(
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--max-image-pixels",
        str(MAX_IMAGE_PIXELS),
        "--allowed-media-domains",
        image_host.removeprefix("http://"),
        "--allowed-media-networks",
        "127.0.0.1",
        "--media-fetch-timeout",
        str(FETCH_TIMEOUT_S),
        "--max-num-batched-tokens",
        "16",
        model=llava,
    )


@pytest.fixture(scope="module")
def client(llava_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_base64_images_in_a_conversation_match_transformers(client: openai.OpenAI, llava: Path) -> None:
    first, second = _image(1), _image(2, 50, 30)
    messages = [
        _user("What is in ", _image_part(_data_url(_encoded(first))), "?"),
        {"role": "assistant", "content": "A picture."},
        _user(
            "Compare it with ",
            _image_part(_data_url(_encoded(second, "WEBP"), "image/webp")),
            " please.",
        ),
    ]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    decoded_second = Image.open(io.BytesIO(_encoded(second, "WEBP"))).convert("RGB")
    answer, prompt_tokens = transformers_chat_answer(
        LlavaForConditionalGeneration, llava, messages, MAX_TOKENS, images=[first, decoded_second]
    )
    assert chat.usage.prompt_tokens == prompt_tokens
    assert chat.choices[0].message.content == answer


def test_the_same_image_is_encoded_once(client: openai.OpenAI, llava_server: ServerProcess) -> None:
    url = _data_url(_encoded(_image(3), "JPEG"), "image/jpeg")
    before = encoder_runs(llava_server)
    answers = [
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("Look: ", _image_part(url))], **GREEDY
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert answers[0] == answers[1]
    assert encoder_runs(llava_server) - before == 1


def test_an_allowed_host_is_fetched(client: openai.OpenAI, image_host: str, llava: Path) -> None:
    messages = [_user("Look: ", _image_part(f"{image_host}/cat.png"))]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    answer, _ = transformers_chat_answer(
        LlavaForConditionalGeneration, llava, messages, MAX_TOKENS, images=[_image(7)]
    )
    assert chat.choices[0].message.content == answer


BAD_IMAGES = {
    "truncated": (_data_url(_encoded(_image(4))[:100]), "cannot be decoded"),
    "gif": (_data_url(_encoded(_image(4), "GIF"), "image/gif"), "not a PNG, JPEG, WEBP image"),
    "not base64": ("data:image/png;base64,@@@", "not valid base64"),
    "not an image": (_data_url(b"hello", "text/plain"), "not an image"),
    "too many pixels": (_data_url(_encoded(_image(5, 201, 200))), "more than the limit"),
    "host not allowed": ("http://localhost:9/cat.png", "not allowed"),
    # The allowed host, on the scheme's default port rather than the one allowed.
    "port not allowed": ("http://127.0.0.1/cat.png", "not allowed"),
    "file without its option": ("file:///etc/hostname", "file: image URLs are not allowed"),
    "scheme": ("ftp://127.0.0.1/cat.png", "must be a data:, http(s) or file: URL"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_are_400s(client: openai.OpenAI, case: str) -> None:
    url, message = BAD_IMAGES[case]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("Look: ", _image_part(url))], **GREEDY
        )
    error = caught.value.body
    assert message in error["message"], error
    assert error["param"] == "messages.0.content.1", error
    # The server keeps serving.
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("Hello")], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS


def _assert_still_serving(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[_user("Look: ", _image_part(_data_url(_encoded(_image(12)))))], **GREEDY
    )
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_the_allowed_host_on_another_port_is_refused(
    client: openai.OpenAI, llava_server: ServerProcess
) -> None:
    """Only the allowed origin's port: not, say, the model server's own API on the same host."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[_user("Look: ", _image_part(f"{llava_server.url}/v1/models"))],
            **GREEDY,
        )
    assert "not allowed (--allowed-media-domains)" in caught.value.body["message"]
    _assert_still_serving(client)


def test_a_host_that_drips_is_cut_at_the_deadline(client: openai.OpenAI, image_host: str) -> None:
    """A byte a second never trips a per-read timeout; the fetch as a whole ends at --media-fetch-timeout,
    and a normal image request beside it completes meanwhile."""
    outcome: dict[str, Any] = {}

    def fetch_dripping() -> None:
        started = time.monotonic()
        try:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[_user("Look: ", _image_part(f"{image_host}/drip"))], **GREEDY
            )
        except openai.BadRequestError as exc:
            outcome["error"] = exc.body
        outcome["seconds"] = time.monotonic() - started

    dripping = threading.Thread(target=fetch_dripping)
    dripping.start()
    _assert_still_serving(client)
    dripping.join(timeout=DRIP_SECONDS + FETCH_MARGIN_S)
    assert FETCH_TIMEOUT_S - 0.5 <= outcome["seconds"] <= FETCH_TIMEOUT_S + FETCH_MARGIN_S, outcome
    assert f"took more than {FETCH_TIMEOUT_S} s" in outcome["error"]["message"], outcome


# A 1 x 40000 PNG (within the pixel limit) resized to the model's 30-pixel side first would be 30 x 1.2M
# pixels, some 360 MiB in the resize and its copies; refused, it costs the API server next to nothing.
THIN_IMAGE_SIDE = MAX_IMAGE_PIXELS
MEMORY_ALLOWANCE_KB = 48 * 1024


def test_a_thin_image_is_refused_before_it_costs_memory(
    client: openai.OpenAI, llava_server: ServerProcess
) -> None:
    thin = Image.fromarray(np.full((THIN_IMAGE_SIDE, 1, 3), 128, dtype=np.uint8))
    url = _data_url(_encoded(thin))
    baseline_kb = reset_peak_rss(llava_server.pid)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("Look: ", _image_part(url))], **GREEDY
        )
    growth_kb = proc_status_kb(llava_server.pid, "VmHWM") - baseline_kb
    assert "aspect ratio is more than the limit of 200" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.0.content.1"
    assert growth_kb < MEMORY_ALLOWANCE_KB, f"the API server's peak RSS grew by {growth_kb} kB"
    _assert_still_serving(client)


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "text"])
def test_a_part_without_the_field_its_type_names_is_a_400(client: openai.OpenAI, kind: str) -> None:
    # An image_url part without image_url was a 500 (the media loader took the image for granted).
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("Look: ", {"type": kind, kind: None})], **GREEDY
        )
    error = caught.value.body
    assert f"a content part of type {kind!r} needs its {kind!r} field" in error["message"], error
    assert error["param"] == "messages.0.content.1", error
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("Hello")], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_too_many_images_is_a_400(client: openai.OpenAI) -> None:
    url = _data_url(_encoded(_image(6)))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[_user(_image_part(url), _image_part(url), _image_part(url))],
            **GREEDY,
        )
    assert "limit of 2" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.0.content.2"


def test_an_image_to_a_text_only_model_is_a_400(api_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[_user("Look: ", _image_part(_data_url(_encoded(_image(8)))))],
            **GREEDY,
        )
    assert "text only" in caught.value.body["message"]
    response = httpx.get(f"{api_server.url}/ready", timeout=10)
    assert response.status_code == 200


def test_an_audio_clip_beside_an_image_is_a_400_naming_the_clip(client: openai.OpenAI) -> None:
    """No model here takes both: LLaVA refuses the audio part of a conversation that has both."""
    image = _image_part(_data_url(_encoded(_image(9))))
    audio = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(b"RIFF").decode(), "format": "wav"},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[_user("See ", image, " and hear ", audio)], **GREEDY
        )
    assert "takes text and image, not audio" in caught.value.body["message"]
    assert caught.value.body["param"] == "messages.0.content.3"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[_user("See ", image)], **GREEDY)
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_redacted_text_keeps_its_place_around_the_image(
    start_server: Callable[..., ServerProcess], llava: Path
) -> None:
    redacting = {"action": "redact", "input": ["rules"], "rules": {}}
    server = start_server("--safety-config", json.dumps(redacting), model=llava)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    image = _image(11)
    url = _data_url(_encoded(image))
    said = [_user("Mail jane@example.com about ", _image_part(url), " and this one.")]
    seen = [_user("Mail [REDACTED:pii/email] about ", _image_part(url), " and this one.")]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=said, **GREEDY)
    answer, prompt_tokens = transformers_chat_answer(
        LlavaForConditionalGeneration, llava, seen, MAX_TOKENS, images=[image]
    )
    assert chat.usage.prompt_tokens == prompt_tokens
    assert chat.choices[0].message.content == answer
