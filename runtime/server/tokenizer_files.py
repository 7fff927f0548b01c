"""GET /kvfleet/tokenizer: the files a router needs to tokenize prompts and hash their blocks as this server
does (kvfleet.contract.tokenizer_files), read once. Only the files named there, never weights; the chat
template is the one the server renders with (--chat-template included)."""

from __future__ import annotations

import base64
from pathlib import Path

from kvfleet.contract.tokenizer_files import MAX_TOTAL_BYTES, MODEL_FILES, TOKENIZER_FILES
from kvfleet.runtime.chat_prompt import read_chat_template
from kvfleet.runtime.config import EngineConfig

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def tokenizer_files(config: EngineConfig) -> dict[str, dict[str, str]]:
    """The response's body; raises ValueError when the files exceed MAX_TOTAL_BYTES."""
    tokenizer_dir = Path(config.tokenizer or config.model)
    sources = [tokenizer_dir / name for name in TOKENIZER_FILES]
    sources += [Path(config.model) / name for name in MODEL_FILES]
    files = {path.name: path.read_bytes() for path in sources if path.is_file()}
    if config.chat_template is not None:
        files.pop("chat_template.json", None)
        files[CHAT_TEMPLATE_FILE] = read_chat_template(config.chat_template).encode()
    total = sum(len(data) for data in files.values())
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"the tokenizer's files take {total} bytes, more than {MAX_TOTAL_BYTES}")
    return {"files": {name: base64.b64encode(data).decode() for name, data in files.items()}}
