"""Loading the model's tokenizer, with the chat template the engine options choose."""

from __future__ import annotations

from kvfleet.runtime.chat_prompt import read_chat_template
from kvfleet.runtime.config import EngineConfig
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with --chat-template applied."""
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer
