"""The gateway's block hashes of a prompt are the engine's: its token ids equal those a real server computes
(a chat with a system prompt and tools, completions of text with and without special tokens, and of token
ids), from tokenizer files fetched from that server without its API key; its hashes equal those of the
engine's own Request for the same prompt, with a LoRA adapter, with a data: URL image on the tiny LLaVA
(prepared by the server's own media code and Transformers' tokenizer), and with a cache_salt, which no two
tenants' blocks share; a Responses API request's are those the server's KV events announce. None of this loads
torch or Transformers in the gateway."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import msgspec
import numpy as np
import pytest
import zmq
from aiohttp import web
from gateway_harness import wait_until
from kvfleet.contract.block_hash import external_block_hash
from kvfleet.contract.errors import MESSAGES_PATH
from kvfleet.contract.tokenizer_files import TOKENIZER_FILES_PATH
from kvfleet.gateway import model_tokenizers
from kvfleet.gateway.model_tokenizers import ModelTokenizers
from kvfleet.gateway.prompt_blocks import ModelPrompts, PromptBlocks, TemplateTokenizer
from kvfleet.gateway.requests import CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH
from kvfleet.runtime.chat_prompt import chat_prompt_token_ids, sample_token_ids
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.kv_cache_utils import extend_block_hashes
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.rope import rope_cache_salt
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.server.tokenizer_files import tokenizer_files
from kvfleet.runtime.serving.media import load_chat_media
from kvfleet.runtime.serving.protocol import ChatMessage, template_messages
from kvfleet.runtime.tokenizer import load_tokenizer
from PIL import Image
from vllm_kv_events import BlockStored, KVEventBatch

if TYPE_CHECKING:
    from servers import ServerProcess

# An adapter's lora_int_id as a replica lists it in its metrics (a digest of its files).
LORA_INT_ID = 98765432123
BLOCK_SIZES = (4, 16)
# The shared server's (the engine's default).
SERVER_BLOCK_SIZE = 16
SYSTEM = "You answer in one short sentence, and you never make up a city's weather. " * 3
LONG_TEXT = "Once upon a time, in a land far away, there lived a tokenizer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Oslo? <|eot_id|> is only text here."},
    ],
    "tools": TOOLS,
    # The tools are rendered into the prompt all the same; "auto" would need a parser on the server.
    "tool_choice": "none",
}


@pytest.fixture(scope="module")
def server(api_server: ServerProcess) -> ServerProcess:
    """The server tests' shared server, which has an API key."""
    return api_server


@pytest.fixture(scope="module")
def fetched(server: ServerProcess) -> ModelPrompts:
    """The tiny model's prompt preparation, from the files the server serves (the client key not sent)."""

    async def fetch() -> ModelPrompts:
        tokenizers = ModelTokenizers({})
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: tokenizers.get("tiny", [server.url], session) is not None)
            prompts = tokenizers.get("tiny", [server.url], session)
            await tokenizers.close()
        assert prompts is not None
        return prompts

    return asyncio.run(fetch())


def _server_prompt(server: ServerProcess, path: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the server computed them (vLLM's return_token_ids)."""
    request = {**body, "max_tokens": 1, "return_token_ids": True}
    answer = httpx.post(f"{server.url}{path}", json=request, headers=server.headers(), timeout=60)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    return reply["prompt_token_ids"] if path == CHAT_PATH else reply["choices"][0]["prompt_token_ids"]


def _engine_hashes(request: Request, block_size: int) -> list[int]:
    """The engine's hashes of the request's full blocks, as its KV cache manager computes them."""
    full_blocks = len(request.all_token_ids) // block_size
    return [external_block_hash(block) for block in extend_block_hashes(request, block_size, full_blocks)]


def _blocks(prompts: ModelPrompts, path: str, body: dict[str, Any]) -> PromptBlocks:
    blocks = prompts.blocks(path, body)
    assert blocks is not None
    return blocks


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT_PATH, CHAT),
        (CHAT_PATH, {**CHAT, "tools": None, "add_generation_prompt": False}),
        *(
            (
                CHAT_PATH,
                {
                    "model": "tiny",
                    "messages": [*CHAT["messages"], {"role": "assistant", "content": answer}],
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                },
            )
            for answer in ("In Oslo it is", " In Oslo it is  ")
        ),
        (COMPLETIONS_PATH, {"model": "tiny", "prompt": "Once upon a time <|begin_of_text|> there"}),
        (COMPLETIONS_PATH, {"model": "tiny", "prompt": "Once upon a time", "add_special_tokens": False}),
        (COMPLETIONS_PATH, {"model": "tiny", "prompt": [[5, 6, 7, 8, 9], [1, 2]]}),
        (CHAT_PATH, {**CHAT, "truncate_prompt_tokens": 9, "truncation_side": "left"}),
        (
            COMPLETIONS_PATH,
            {"model": "tiny", "prompt": LONG_TEXT, "truncate_prompt_tokens": 4, "truncation_side": "right"},
        ),
        (COMPLETIONS_PATH, {"model": "tiny", "prompt": "Once upon", "truncate_prompt_tokens": 40}),
    ],
    ids=[
        "chat-system-tools",
        "chat-no-generation-prompt",
        "chat-continued",
        "chat-continued-spaced",
        "text",
        "text-no-special",
        "token-ids",
        "chat-cut-left",
        "text-cut-right",
        "text-short-of-the-cut",
    ],
)
def test_the_gateways_token_ids_are_the_servers(
    server: ServerProcess, fetched: ModelPrompts, path: str, body: dict[str, Any]
) -> None:
    """A batch of completion prompts is routed on its first."""
    assert _blocks(fetched, path, body).token_ids == _server_prompt(server, path, body)


def test_the_gateways_hashes_are_the_engines_with_and_without_an_adapter(
    server: ServerProcess, fetched: ModelPrompts
) -> None:
    token_ids = _server_prompt(server, CHAT_PATH, CHAT)
    blocks = _blocks(fetched, CHAT_PATH, CHAT)
    adapter = LoRARequest("sql", LORA_INT_ID, "/adapters/sql")
    for block_size in BLOCK_SIZES:
        base = Request("base", token_ids, SamplingParams())
        with_adapter = Request("sql", token_ids, SamplingParams(), lora_request=adapter)
        assert list(blocks(block_size, 0)) == _engine_hashes(base, block_size)
        assert list(blocks(block_size, LORA_INT_ID)) == _engine_hashes(with_adapter, block_size)
        assert len(blocks(block_size, 0)) == len(token_ids) // block_size > 1
        assert not set(blocks(block_size, 0)) & set(blocks(block_size, LORA_INT_ID))


# A conversation with a call and its answer, asked through the Responses API and through the Messages API.
RESPONSES_BODY: dict[str, Any] = {
    "model": "tiny",
    "instructions": SYSTEM,
    "input": [
        {"type": "message", "role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Rain, 4 degrees."},
    ],
    "tools": [{"type": "function", **TOOLS[0]["function"]}],
    # The tools are rendered into the prompt all the same; "auto" would need a parser on the server.
    "tool_choice": "none",
    "max_output_tokens": 1,
}
WEATHER = TOOLS[0]["function"]
MESSAGES_BODY: dict[str, Any] = {
    "model": "tiny",
    "system": SYSTEM,
    "messages": [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "Rain, 4 degrees."}],
        },
    ],
    "tools": [
        {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "input_schema": WEATHER["parameters"],
        }
    ],
    "tool_choice": {"type": "none"},
    "max_tokens": 1,
}


@pytest.mark.parametrize(
    ("path", "body"),
    [(RESPONSES_PATH, RESPONSES_BODY), (MESSAGES_PATH, MESSAGES_BODY)],
    ids=["responses", "messages"],
)
def test_a_conversation_of_another_api_is_hashed_as_the_engine_announces_its_blocks(
    server: ServerProcess, fetched: ModelPrompts, api_server_events_port: int, path: str, body: dict[str, Any]
) -> None:
    """A Responses or Messages API request (a system prompt, a conversation with a call and its answer, a
    tenant's cache_salt) hashed as the chat the replica answers it with: the blocks the engine's KV events
    announce for it. A salt of its own for each try: blocks already cached are not announced again, and the
    subscription starts receiving some time after it connects."""
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{api_server_events_port}")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        for attempt in range(20):
            salted = {**body, "cache_salt": f"{path}-{attempt}"}
            expected = list(_blocks(fetched, path, salted)(SERVER_BLOCK_SIZE, 0))
            answer = httpx.post(f"{server.url}{path}", json=salted, headers=server.headers(), timeout=60)
            assert answer.status_code == 200, answer.text
            announced: list[int] = []
            while not set(expected) <= set(announced) and subscriber.poll(2000):
                for event in decoder.decode(subscriber.recv_multipart()[2]).events:
                    if isinstance(event, BlockStored) and event.medium == "GPU":
                        announced += event.block_hashes
            if announced:
                assert len(expected) > 1 and set(expected) <= set(announced), (expected, announced)
                return
        raise AssertionError("no KV event reached the subscriber")
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize(
    "cut", [{"truncate_prompt_tokens": 4}, {"truncate_prompt_tokens": -1, "truncation_side": "left"}]
)
def test_a_cut_the_replica_decides_gets_no_hashes(fetched: ModelPrompts, cut: dict[str, Any]) -> None:
    """Without truncation_side the replica cuts a text around its tokenizer's special tokens, and -1 to its
    context: the gateway knows neither, and routes such a prompt without hashes."""
    assert fetched.blocks(COMPLETIONS_PATH, {"model": "tiny", "prompt": LONG_TEXT, **cut}) is None


def test_tenants_with_different_salts_share_no_block(fetched: ModelPrompts) -> None:
    unsalted = _blocks(fetched, CHAT_PATH, CHAT)(16, 0)
    salted = {salt: _blocks(fetched, CHAT_PATH, {**CHAT, "cache_salt": salt})(16, 0) for salt in "ab"}
    assert len(salted["a"]) == len(salted["b"]) == len(unsalted)
    assert not set(salted["a"]) & set(salted["b"])
    assert not (set(salted["a"]) | set(salted["b"])) & set(unsalted)
    assert _blocks(fetched, CHAT_PATH, {**CHAT, "cache_salt": "a"})(16, 0) == salted["a"]
    # The engine's hashes of the same prompt under the same salt.
    token_ids = _blocks(fetched, CHAT_PATH, CHAT).token_ids
    for salt in "ab":
        request = Request("salted", token_ids, SamplingParams(), cache_salt=salt)
        assert list(salted[salt]) == _engine_hashes(request, 16)
    for refused in ("", "x" * 1025, 7):
        assert fetched.blocks(CHAT_PATH, {**CHAT, "cache_salt": refused}) is None


@pytest.fixture(scope="module")
def llava(make_model: Callable[..., Path]) -> Path:
    return make_model("llava", "tiny")


def _image_chat(url: str) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "What is in this picture, and " * 4},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what colour is it?"},
    ]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}]}


def _png_data_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(36, 44, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _server_front_end(llava: Path, body: dict[str, Any]) -> tuple[list[int], list[MultiModalFeature]]:
    """The prompt and its image as the server prepares them: Transformers' tokenizer and the server's media
    loading."""
    config = EngineConfig(model=str(llava))
    messages = [ChatMessage.model_validate(message) for message in body["messages"]]
    token_ids = chat_prompt_token_ids(
        load_tokenizer(config), template_messages(messages), add_generation_prompt=True
    )

    async def expand() -> tuple[list[int], list[MultiModalFeature]]:
        media = await load_chat_media(config, messages)
        assert media is not None
        return await media.expand(token_ids)

    return asyncio.run(expand())


def test_an_images_blocks_are_hashed_as_the_engine_hashes_them(llava: Path) -> None:
    prompts = ModelPrompts(llava)
    body = _image_chat(_png_data_url(1))
    token_ids, features = _server_front_end(llava, body)
    blocks = _blocks(prompts, CHAT_PATH, body)
    assert blocks.token_ids == token_ids
    request = Request("image", token_ids, SamplingParams(), mm_features=features)
    assert list(blocks(16, 0)) == _engine_hashes(request, 16)
    other_image = _blocks(prompts, CHAT_PATH, _image_chat(_png_data_url(2)))
    assert other_image.token_ids == token_ids, "the same placeholders stand for any image"
    image_block = features[0].offset // 16
    assert other_image(16, 0)[:image_block] == blocks(16, 0)[:image_block]
    assert other_image(16, 0)[image_block] != blocks(16, 0)[image_block]


def test_what_the_gateway_cannot_prepare_as_a_replica_gets_no_hashes(llava: Path) -> None:
    """An image by URL is never fetched; a body the server refuses; audio on a model without it."""
    prompts = ModelPrompts(llava)
    assert prompts.blocks(CHAT_PATH, _image_chat("https://example.com/cat.png")) is None
    assert prompts.blocks(CHAT_PATH, _image_chat("data:image/png;base64,AAAA")) is None
    assert prompts.blocks(CHAT_PATH, {"model": "tiny", "messages": "hello"}) is None
    assert prompts.blocks(COMPLETIONS_PATH, {"model": "tiny", "prompt": []}) is None
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert (
        prompts.blocks(CHAT_PATH, {"model": "tiny", "messages": [{"role": "user", "content": [audio]}]})
        is None
    )


_PROBE = """
import json, sys
from kvfleet.gateway.prompt_blocks import ModelPrompts
blocks = ModelPrompts(sys.argv[1]).blocks("/v1/chat/completions", json.loads(sys.argv[2]))
print(json.dumps([blocks(16, 3)[0], "torch" in sys.modules, "transformers" in sys.modules]))
"""


def test_preparing_a_prompt_with_an_image_loads_neither_torch_nor_transformers(llava: Path) -> None:
    body = _image_chat(_png_data_url(1))
    result = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE, str(llava), json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    first_hash, torch_loaded, transformers_loaded = json.loads(result.stdout)
    assert first_hash == ModelPrompts(llava).blocks(CHAT_PATH, body)(16, 3)[0]
    assert not torch_loaded and not transformers_loaded


def test_a_replicas_tokenizer_answer_is_bounded_and_fetched_once(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names outside the contract's are dropped (a path among them included); an answer past the byte cap,
    not the contract's (its chat rendering included), or whose files do not tokenize the samples as the
    replica's tokenizer did gives no tokenizer; a model has one fetch in flight, and none again within
    RETRY_AFTER_S of a failure."""
    files = {path.name: base64.b64encode(path.read_bytes()).decode() for path in tiny_llama.glob("*.json")}
    escape = tmp_path / "escaped"
    samples = sample_token_ids(load_tokenizer(EngineConfig(model=str(tiny_llama))))
    extra = {str(escape): files["config.json"], "x.bin": "AAAA"}
    disagreeing = {**samples, "text": [*samples["text"], 0]}
    answers: dict[str, bytes] = {
        "good": json.dumps({"files": {**files, **extra}, "samples": samples}).encode(),
        "garbage": b"\xff{not json",
        "no-tokenizer": json.dumps({"files": {"config.json": files["config.json"]}}).encode(),
        "disagreeing": json.dumps({"files": files, "samples": disagreeing}).encode(),
        "bad-rendering": json.dumps(
            {"files": files, "samples": samples, "chat_rendering": {"default_chat_template_kwargs": []}}
        ).encode(),
    }
    answers["large"] = json.dumps({"files": {**files, "padding.bin": "A" * len(answers["good"])}}).encode()
    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.match_info["kind"])
        await asyncio.sleep(0.05)  # long enough for a second request to find the fetch in flight
        return web.Response(body=answers[request.match_info["kind"]], content_type="application/json")

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/{kind}" + TOKENIZER_FILES_PATH, answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        tokenizers = ModelTokenizers({})
        try:
            async with aiohttp.ClientSession() as session:
                for kind in answers:
                    for _ in range(3):
                        assert tokenizers.get(kind, [f"{base}/{kind}"], session) is None
                    await wait_until(lambda kind=kind: kind not in tokenizers._fetches)
                prompts = tokenizers.get("good", [f"{base}/good"], session)
                assert prompts is not None
                assert prompts.blocks(COMPLETIONS_PATH, {"model": "m", "prompt": "hi"}) is not None
                for kind in ("garbage", "no-tokenizer", "disagreeing", "bad-rendering", "large"):
                    assert tokenizers.get(kind, [f"{base}/{kind}"], session) is None
        finally:
            await tokenizers.close()
            await runner.cleanup()

    monkeypatch.setattr(model_tokenizers, "MAX_ANSWER_BYTES", len(answers["good"]))
    asyncio.run(scenario())
    assert asked == list(answers), "one fetch per model, and none again after a failure"
    assert not escape.exists()


def test_a_replica_serves_its_tokenizer_files_and_its_own_chat_template(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Never the weights; with --chat-template, the template the server renders with, which the gateway then
    renders too."""
    template = "{% for message in messages %}<<{{ message['content'] }}>>{% endfor %}"
    config = EngineConfig(model=str(tiny_llama), chat_template=template)
    files = {name: base64.b64decode(data) for name, data in tokenizer_files(config)["files"].items()}
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    expected = chat_prompt_token_ids(
        load_tokenizer(config), [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert _blocks(ModelPrompts(tmp_path), CHAT_PATH, body).token_ids == expected
    assert expected != _blocks(ModelPrompts(tiny_llama), CHAT_PATH, body).token_ids


def test_a_long_prompt_on_a_length_dependent_rope_is_salted_as_the_engine_salts_it(
    tiny_llama: Path, tmp_path: Path
) -> None:
    for path in tiny_llama.glob("*.json"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_type": "dynamic", "factor": 2.0}
    config["max_position_embeddings"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    rope = ModelConfig.from_folder(tmp_path).rope
    prompts = ModelPrompts(tmp_path)
    for length in (64, 65):
        token_ids = list(range(5, 5 + length))
        blocks = _blocks(prompts, COMPLETIONS_PATH, {"model": "tiny", "prompt": token_ids})
        request = Request("long", token_ids, SamplingParams(), model_salt=rope_cache_salt(rope, length))
        assert list(blocks(16, 0)) == _engine_hashes(request, 16)
    short, long = (
        _blocks(prompts, COMPLETIONS_PATH, {"model": "tiny", "prompt": list(range(5, 5 + length))})(16, 0)
        for length in (64, 65)
    )
    assert not set(short) & set(long), "a prompt past the original length shares no block with shorter ones"


def test_templates_render_as_transformers_renders_them(tiny_llama: Path) -> None:
    """Generation blocks, loop controls, an unescaped tojson, the special tokens as variables and
    raise_exception."""
    template = (
        "{% for message in messages %}{% if message.role == 'assistant' %}{% generation %}"
        "A: {{ message.content }}{% endgeneration %}{% else %}"
        "{{ message.role }}: {{ message.content | tojson }}\n{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}{{ bos_token }}{{ eos_token }}"
        "{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}"
    )
    messages = [
        {"role": "user", "content": "héllo <b>&"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
        {"role": "user", "content": "never shown"},
    ]
    transformers_tokenizer = load_tokenizer(EngineConfig(model=str(tiny_llama), chat_template=template))
    gateway_tokenizer = TemplateTokenizer.from_folder(tiny_llama)
    gateway_tokenizer.chat_template = template
    rendered = [
        chat_prompt_token_ids(tokenizer, messages, add_generation_prompt=False)
        for tokenizer in (transformers_tokenizer, gateway_tokenizer)
    ]
    assert rendered[0] == rendered[1]
    for tokenizer in (transformers_tokenizer, gateway_tokenizer):
        with pytest.raises(ValueError, match="too long"):
            chat_prompt_token_ids(tokenizer, messages * 3, add_generation_prompt=False)
