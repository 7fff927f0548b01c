"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's configuration as
Transformers loaded it, for clients that tokenize as the server does. It may show the chat template, so it is
served only when asked for."""

from __future__ import annotations

from typing import Any

# Where the tokenizer's files lie on this machine: nothing a client can use.
_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer's init_kwargs without file paths, its class, and the chat template the server renders
    with where it has one of its own (--chat-template)."""
    info = {
        name: _as_json(value) for name, value in tokenizer.init_kwargs.items() if name not in _PATH_FIELDS
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template is not None:
        info["chat_template"] = chat_template
    return info


def _as_json(value: Any) -> Any:
    """Special tokens (Transformers' AddedToken) as their text; containers walked; what JSON cannot hold as
    its string."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): _as_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_as_json(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
