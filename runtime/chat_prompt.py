"""A chat conversation as prompt token ids: the template's markup with its special tokens, message text as
plain text.

Rendering the template to one string and tokenizing that would turn any special-token string a user typed
(`<|eot_id|>`, the bos or eos token, ...) into a real turn marker or end of text. So every special-token
string in the messages is swapped for a private-use character before rendering, the special tokens left in
the rendering are the template's own, and the text between them (with the swapped strings put back) is
tokenized with special-token strings read as text, as OpenAI does with message content. For messages without
special-token strings, the result is exactly `tokenizer.apply_chat_template(..., tokenize=True)`.

A pure function of the tokenizer and the messages, safe to call from any thread: it never changes the
tokenizer's state (Transformers' `split_special_tokens=True` would, on the shared tokenizer).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.contract.tokenizer_files import SAMPLE_MESSAGES, SAMPLE_TEXT
from kvfleet.runtime.chat_content_format import (
    ContentFormatOption,
    formatted_messages,
    resolve_content_format,
)

# Supplementary Private Use Area-A: characters no tokenizer gives meaning to, and no template strips.
_PRIVATE_USE = range(0xF0000, 0xFFFFE)


@dataclass(frozen=True)
class _SpecialTokens:
    ids: dict[str, int]
    # Matches any special token, longest first; None when the tokenizer has none.
    pattern: re.Pattern[str] | None
    # The tokenizer's backend, reading special-token strings as text.
    text_encoder: Any


@functools.lru_cache(maxsize=8)
def _special_tokens(tokenizer: Any) -> _SpecialTokens:
    from tokenizers import Tokenizer

    added = tokenizer.added_tokens_decoder.items()
    ids = {token.content: token_id for token_id, token in added if token.special}
    longest_first = sorted(ids, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, longest_first))) if ids else None
    text_encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    text_encoder.encode_special_tokens = True
    return _SpecialTokens(ids, pattern, text_encoder)


def chat_prompt_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    content_format: ContentFormatOption = "auto",
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of `messages` (role/content dicts, content a string or OpenAI's parts) rendered by
    `chat_template` (by default the tokenizer's), their content as `content_format` has it
    (kvfleet.runtime.chat_content_format), with the `tools` (OpenAI's function definitions) the template
    shows the model and `template_kwargs`, variables the template reads (see `rendering_parameters` for the
    names they may not take); with `continue_final_message`, ending within the last message for the model to
    go on with it.

    Raises ValueError when the tokenizer has no chat template or the template rejects the messages.
    """
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ValueError("the model has no chat template")
    resolved = resolve_content_format(content_format, template, tools=bool(tools))
    messages = formatted_messages(messages, resolved)
    template_kwargs = template_kwargs or {}
    special = _special_tokens(tokenizer)
    if special.pattern is None:
        text = _render(
            tokenizer,
            chat_template,
            messages,
            add_generation_prompt,
            continue_final_message,
            tools,
            template_kwargs,
        )
        return _encode(special.text_encoder, text)
    free = _free_characters(len(special.ids), [messages, tools, template_kwargs], template)
    stand_ins = dict(zip(special.ids, free, strict=True))
    pattern = special.pattern

    def escape(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda match: stand_ins[match.group()], value)
        if isinstance(value, list):
            return [escape(item) for item in value]
        if isinstance(value, dict):
            return {key: escape(item) for key, item in value.items()}
        return value

    text = _render(
        tokenizer,
        chat_template,
        escape(messages),
        add_generation_prompt,
        continue_final_message,
        escape(tools),
        escape(template_kwargs),
    )
    restore = {ord(stand_in): token for token, stand_in in stand_ins.items()}
    token_ids: list[int] = []
    position = 0
    for match in pattern.finditer(text):
        token_ids += _encode_text(special, text[position : match.start()], restore)
        token_ids.append(special.ids[match.group()])
        position = match.end()
    token_ids += _encode_text(special, text[position:], restore)
    return token_ids


def _render(
    tokenizer: Any,
    chat_template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
) -> str:
    try:
        # The tokenizer's own template (which may be several, named) unless one is given.
        given = {"chat_template": chat_template} if chat_template is not None else {}
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **given,
            **template_kwargs,
        )
    except Exception as exc:
        # Templates refuse conversations they cannot render (role order, unknown roles) by raising.
        raise ValueError(f"the chat template rejected the messages: {exc}") from None


def _encode_text(special: _SpecialTokens, text: str, restore: dict[int, str]) -> list[int]:
    if not text:
        return []
    return _encode(special.text_encoder, text.translate(restore))


def _encode(encoder: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    # The batch call releases the interpreter lock while it encodes; the single-text one does not.
    return encoder.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def sample_token_ids(tokenizer: Any) -> dict[str, list[int] | None]:
    """The token ids of the contract's samples (kvfleet.contract.tokenizer_files): its text with the
    tokenizer's special tokens added, as a completion's prompt is encoded, and its conversation rendered
    with a generation prompt (None without a chat template). Two tokenizers that agree on them read the
    same files the same way."""
    text = _encode(tokenizer.backend_tokenizer, SAMPLE_TEXT, add_special_tokens=True)
    try:
        chat = chat_prompt_token_ids(tokenizer, list(SAMPLE_MESSAGES), add_generation_prompt=True)
    except ValueError:
        chat = None
    return {"text": text, "chat": chat}


def prompt_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text a model reads in prompt token ids, each special token (a template's turn markers) read as a
    line break: left out, they would run one turn's last word into the next turn's first."""
    special = set(_special_tokens(tokenizer).ids.values())
    runs: list[list[int]] = [[]]
    for token_id in token_ids:
        if token_id in special:
            runs.append([])
        else:
            runs[-1].append(token_id)
    return "\n".join(tokenizer.batch_decode([run for run in runs if run]))


def rendering_parameters(tokenizer: Any) -> frozenset[str]:
    """The names `apply_chat_template` takes as its own parameters (tokenize, chat_template, ...): template
    variables given under these names would change how the prompt is rendered, not what the template reads."""
    return _parameters(tokenizer.apply_chat_template)


@functools.lru_cache(maxsize=8)
def _parameters(function: Any) -> frozenset[str]:
    parameters = inspect.signature(function).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


@functools.lru_cache(maxsize=8)
def longest_token_characters(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its vocabulary's longest entry (byte-level
    vocabularies spell a byte as one character, so this bounds bytes too)."""
    return max(len(token) for token in tokenizer.get_vocab())


def _free_characters(count: int, conversation: Any, template: str) -> list[str]:
    """`count` consecutive private-use characters found neither in the conversation nor in the template."""
    texts = [*text_fields(conversation), template]
    used = {ord(char) for text in texts for char in text if ord(char) in _PRIVATE_USE}
    start = _PRIVATE_USE.start
    for code in sorted(used):
        if code - start >= count:
            break
        start = code + 1
    if start + count > _PRIVATE_USE.stop:
        raise ValueError("the messages use too many private-use characters")
    return [chr(code) for code in range(start, start + count)]


def text_fields(value: Any) -> list[str]:
    """Every string in a structure of lists and dicts (a conversation)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [text for item in value for text in text_fields(item)]
    if isinstance(value, dict):
        return [text for item in value.values() for text in text_fields(item)]
    return []


def read_chat_template(value: str) -> str:
    """A path to a template file, or the template itself (as vLLM's --chat-template takes it)."""
    if "{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"chat template {value!r} is neither a readable file nor a Jinja template")
    return path.read_text()
