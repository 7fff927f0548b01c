"""Loading the model's tokenizer, with the chat template the engine options choose."""

from __future__ import annotations

from pathlib import Path

from kvfleet.runtime.config import EngineConfig
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def read_chat_template(value: str) -> str:
    """A path to a template file, or the template itself (as vLLM's --chat-template takes it)."""
    if "{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"chat template {value!r} is neither a readable file nor a Jinja template")
    return path.read_text()


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with --chat-template applied."""
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer
