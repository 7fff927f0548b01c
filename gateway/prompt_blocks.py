"""A prompt's prefix-cache block hashes, computed by the gateway exactly as a replica's engine computes them
(kvfleet.contract.block_hash), so that routing can look them up among the blocks replicas publish.

The prompt's token ids come from the model's own tokenizer files, read with `tokenizers` and the chat
template rendered with Jinja as Transformers renders it (Transformers itself loads torch wherever torch is
installed, and the gateway never does). A chat goes through the server's own steps: the protocol's
messages, kvfleet.runtime.chat_prompt, and for images given as `data:` URLs the runtime's media
preparation, so that placeholders are expanded and content hashes taken as the engine takes them. A
completion's text is encoded as the server encodes it (its add_special_tokens, the BOS of the tokenizer's
post-processor). What the gateway cannot reproduce gets no hashes, and routing falls back: an image by URL
(the gateway fetches nothing), audio, a body the server would refuse.

The chain's seed holds the request's `cache_salt`, the rope salt of a long prompt on a model whose rope
depends on the length, and the LoRA adapter's `lora_int_id`, which differs by replica only if their adapter
files differ: the hashes are a function of (block size, lora_int_id), each computed once per request. Those of
the usual block size and the adapter ids the replicas list are computed with the tokens, on a worker thread;
another block size is hashed where it is first asked for (SHA-256 over the prompt, some 0.5 ms per thousand
tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from kvfleet.contract.block_hash import block_hashes, chain_seed, external_block_hash
from kvfleet.contract.errors import MESSAGES_PATH, BadRequestError
from kvfleet.gateway.requests import CHAT_PATH, RESPONSES_PATH
from kvfleet.runtime.chat_content_format import GenerationBlocks
from kvfleet.runtime.chat_prompt import chat_prompt_token_ids
from kvfleet.runtime.config import DEFAULT_ITEMS_PER_PROMPT, EngineConfig
from kvfleet.runtime.models.rope import rope_cache_salt, rope_parameters
from kvfleet.runtime.multimodal.image_processor import data_url_bytes, decode_image
from kvfleet.runtime.multimodal.inputs import MediaInputError
from kvfleet.runtime.multimodal.prompt_media import PromptMedia, modality_specs
from kvfleet.runtime.serving.chat_rendering import DEFAULT_RENDERING, ChatRendering
from kvfleet.runtime.serving.messages_protocol import MessagesRequest
from kvfleet.runtime.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    media_parts,
    template_messages,
)
from kvfleet.runtime.serving.responses_protocol import ResponsesRequest
from pydantic import ValidationError
from tokenizers import Tokenizer

# The special tokens a chat template reads by name (Transformers' named special tokens).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# A replica's defaults: it refuses larger images (decoding one costs memory first), and more of them.
MAX_IMAGE_PIXELS = EngineConfig.max_image_pixels
MAX_PROMPT_IMAGES = DEFAULT_ITEMS_PER_PROMPT
# The block size of the runtime's and vLLM's engines unless set otherwise: a prompt's hashes for it are
# computed with its tokens, off the event loop.
USUAL_BLOCK_SIZE = 16
# vLLM's bound on cache_salt; a replica refuses a longer one (and the request gets no hashes here).
MAX_CACHE_SALT_CHARS = 1024


class TemplateTokenizer:
    """A model's fast tokenizer and chat template, answering what kvfleet.runtime.chat_prompt asks of
    Transformers' tokenizer: `backend_tokenizer`, `added_tokens_decoder`, `chat_template` and
    `apply_chat_template(..., tokenize=False)`, rendered in Transformers' sandbox (trimmed blocks, loop
    controls, generation blocks, its `tojson`, `raise_exception` and `strftime_now`) with the named special
    tokens as variables."""

    def __init__(
        self, backend: Tokenizer, chat_template: str | dict[str, str] | None, special: dict[str, str]
    ) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = special
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_folder(cls, folder: Path) -> TemplateTokenizer:
        config = _json_file(folder / "tokenizer_config.json")
        special = {**_json_file(folder / "special_tokens_map.json"), **config}
        named = {name: _token_text(special[name]) for name in NAMED_SPECIAL_TOKENS if special.get(name)}
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        else:
            template = _json_file(folder / "chat_template.json").get("chat_template") or config.get(
                "chat_template"
            )
        if isinstance(template, list):  # named templates, as tokenizer_config.json may list them
            template = {entry["name"]: entry["template"] for entry in template}
        path = folder / "tokenizer.json"
        text = path.read_text()
        try:
            backend = Tokenizer.from_str(text)
        except Exception as error:  # `tokenizers` raises Exception itself
            raise ValueError(f"{path} is not a tokenizer: {error}") from None
        return cls(backend, template, named)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        assert not tokenize, "chat_prompt tokenizes the rendering itself"
        template = self._template(tools)
        variables = {**self.special_tokens_map, **template_kwargs}
        rendered = template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return _continued(rendered, messages[-1]) if continue_final_message else rendered

    def _template(self, tools: list[dict[str, Any]] | None) -> jinja2.Template:
        source = self.chat_template
        if isinstance(source, dict):
            source = source["tool_use"] if tools and "tool_use" in source else source["default"]
        assert source is not None, "chat_prompt refuses a tokenizer without a template first"
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = _environment().from_string(source)
        return compiled


def _continued(rendered: str, final: dict[str, Any]) -> str:
    """The rendering cut where the final message's text ends (its last text part's), for the model to go on
    with it, as Transformers cuts it: the template's end-of-turn markup after it goes, and spacing the
    template trimmed from its end stays trimmed."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [part["text"] for part in content if isinstance(part, dict) and "text" in part]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or content.strip() not in rendered:
        raise ValueError("the final message's text, to continue, is not in the rendered chat")
    start = rendered.rindex(content.strip())
    kept = content.lstrip()
    end = (
        start + len(kept) if rendered[start : start + len(kept)] == content else start + len(content.strip())
    )
    return rendered[:end]


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Unlike Jinja's own filter, no HTML escaping: the prompt is not a web page.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def _json_file(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict[str, Any]) -> str:
    """A special token as tokenizer_config.json spells it: its text, or an added token's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


@dataclass(frozen=True)
class _Span:
    """An image's placeholder tokens and content hash (kvfleet.contract.block_hash.MediaSpan)."""

    offset: int
    end: int
    identifier: bytes


@dataclass
class PromptBlocks:
    """A prompt's tokens and chain keys; called with a replica's block size and its lora_int_id for the
    request's adapter (0 for the base model), the external hashes of the prompt's full blocks."""

    token_ids: list[int]
    media: tuple[_Span, ...] = ()
    cache_salt: str | None = None
    model_salt: bytes | None = None
    _hashes: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, repr=False)

    def __call__(self, block_size: int, lora_int_id: int) -> Sequence[int]:
        key = (block_size, lora_int_id)
        hashes = self._hashes.get(key)
        if hashes is None:
            seed = chain_seed(lora_int_id, self.cache_salt, self.model_salt)
            chain = block_hashes(self.token_ids, block_size, seed, self.media)
            hashes = self._hashes[key] = tuple(external_block_hash(block) for block in chain)
        return hashes


class ModelPrompts:
    """One model's tokenizer and media preparation, read from a folder of its files
    (kvfleet.contract.tokenizer_files.FILES)."""

    def __init__(self, folder: str | Path, rendering: ChatRendering = DEFAULT_RENDERING) -> None:
        """`rendering`: the replicas' settings of chat prompts (a local folder's model: the defaults)."""
        folder = Path(folder)
        self.tokenizer = TemplateTokenizer.from_folder(folder)
        self.rendering = rendering
        config = _json_file(folder / "config.json")
        text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        self.rope = rope_parameters(text_config, str(folder / "config.json"))
        specs = modality_specs(config, folder)
        # Audio preparation needs Transformers' feature extractor (and so torch): audio prompts get no hashes.
        self.media = (
            PromptMedia.for_model(folder, {"image": MAX_PROMPT_IMAGES}, None)
            if "image" in specs and "audio" not in specs
            else None
        )

    def blocks(
        self, path: str, payload: Mapping[str, Any], lora_int_ids: Iterable[int] = (0,)
    ) -> PromptBlocks | None:
        """The prompt of a completion request's body (on `path`) as the engine will hash it, its hashes for
        USUAL_BLOCK_SIZE and each of `lora_int_ids` computed already; None when the gateway cannot compute
        it as a replica would. A batch of completion prompts is routed on its first. Runs the tokenizer
        and hashes the prompt: call it off the event loop."""
        salt = payload.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            return None
        try:
            if path == CHAT_PATH:
                prepared = self._chat(ChatCompletionRequest.model_validate(payload))
            elif path == RESPONSES_PATH:
                prepared = self._response(payload)
            elif path == MESSAGES_PATH:
                prepared = self._message(payload)
            else:
                prepared = self._completion(payload)
        except (ValidationError, ValueError, MediaInputError, BadRequestError):
            return None  # the replica refuses what the server's own steps refuse here
        if prepared is None:
            return None
        token_ids, media = prepared
        blocks = PromptBlocks(token_ids, media, salt, rope_cache_salt(self.rope, len(token_ids)))
        for lora_int_id in lora_int_ids:
            blocks(USUAL_BLOCK_SIZE, lora_int_id)
        return blocks

    def _response(self, payload: Mapping[str, Any]) -> tuple[list[int], tuple[_Span, ...]] | None:
        """A Responses API request as the chat the replica answers it with."""
        body = ResponsesRequest.model_validate(payload)
        body.check()
        if body.previous_response_id is not None or body.truncation == "auto":
            return None  # a stored conversation, or turns the replica's context may drop
        return self._chat(body.chat_request(body.input_messages()))

    def _message(self, payload: Mapping[str, Any]) -> tuple[list[int], tuple[_Span, ...]] | None:
        """A Messages API request as the chat the replica answers it with."""
        body = MessagesRequest.model_validate(payload)
        body.check()
        return self._chat(body.chat_request())

    def _chat(self, body: ChatCompletionRequest) -> tuple[list[int], tuple[_Span, ...]] | None:
        if body.chat_template is not None:
            return None  # the replica renders it if it trusts it: a 400 otherwise
        rendering = self.rendering
        token_ids = chat_prompt_token_ids(
            self.tokenizer,
            template_messages(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            tools=rendering.tools(body),
            template_kwargs=rendering.chat_template_kwargs(body),
            continue_final_message=body.continue_final_message,
            content_format=rendering.chat_template_content_format,
        )
        cut = body.truncated(token_ids)
        parts = media_parts(body.messages)
        if not parts:
            return None if cut is None else (cut, ())
        if cut != token_ids:
            return None  # the replica refuses to cut a prompt with media
        images = []
        for _, modality, part in parts:
            if modality != "image" or self.media is None or part.image_url is None:
                return None
            url = part.image_url.url
            if not url.startswith("data:"):
                return None  # never fetched by the gateway
            images.append(decode_image(data_url_bytes(url), max_pixels=MAX_IMAGE_PIXELS))
        token_ids, features = self.media.prepare(token_ids, {"image": images})
        return token_ids, tuple(_Span(item.offset, item.end, item.identifier) for item in features)

    def _completion(self, payload: Mapping[str, Any]) -> tuple[list[int], tuple[_Span, ...]] | None:
        body = CompletionRequest.model_validate(payload)
        if body.embedded_prompts():
            return None  # prompt embeddings, which the replica runs first, are not tokens to hash
        prompt = body.prompts()[0]
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        else:
            token_ids = list(prompt)
        cut = body.truncated(token_ids)
        return None if cut is None else (cut, ())
