"""Where the gateway gets each model's tokenizer: a local folder (`kvfleet gateway --tokenizer NAME=PATH`), or
else the files a ready replica of the model serves (kvfleet.contract.tokenizer_files), fetched once.

A fetch never holds a request: requests that arrive before the model's tokenizer is ready are routed without
block hashes. One fetch per model is in flight at a time, within a deadline and a byte cap; only the files the
contract names are kept, written under those names only (never a path the answer gives), and read
once into memory, and used only if they tokenize the contract's samples exactly as the replica's own tokenizer
does. A failed fetch is tried again, from any replica, RETRY_AFTER_S later.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from kvfleet.contract.tokenizer_files import FILES, MAX_TOTAL_BYTES, TOKENIZER_FILES_PATH
from kvfleet.gateway.prompt_blocks import ModelPrompts
from kvfleet.runtime.chat_prompt import sample_token_ids
from kvfleet.runtime.serving.chat_rendering import DEFAULT_RENDERING, ChatRendering

logger = logging.getLogger(__name__)

# A replica reads the files from its own disk: the deadline is for a slow network.
FETCH_TIMEOUT_S = 30.0
RETRY_AFTER_S = 30.0
# The answer's base64 is 4/3 of the files, plus the JSON around it.
MAX_ANSWER_BYTES = MAX_TOTAL_BYTES * 4 // 3 + 64 * 1024


class ModelTokenizers:
    """Each model's prompt preparation (ModelPrompts), by the model's gateway name (a base model's)."""

    def __init__(self, local: Mapping[str, ModelPrompts]) -> None:
        self._prompts = dict(local)
        self._fetches: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}

    def get(
        self, model: str, replica_urls: Sequence[str], session: aiohttp.ClientSession
    ) -> ModelPrompts | None:
        """The model's prompt preparation; None while it is fetched (a fetch from `replica_urls` starts
        unless one is in flight or failed lately)."""
        prompts = self._prompts.get(model)
        if prompts is not None or not replica_urls or model in self._fetches:
            return prompts
        failed_at = self._failed_at.get(model)
        if failed_at is not None and time.monotonic() - failed_at < RETRY_AFTER_S:
            return None
        self._fetches[model] = asyncio.create_task(
            self._fetch(model, tuple(replica_urls), session), name=f"kvfleet-gateway-tokenizer-{model}"
        )
        return None

    async def close(self) -> None:
        for task in self._fetches.values():
            task.cancel()
        await asyncio.gather(*self._fetches.values(), return_exceptions=True)

    async def _fetch(self, model: str, urls: tuple[str, ...], session: aiohttp.ClientSession) -> None:
        try:
            for url in urls:
                try:
                    files, samples, rendering = await _files_of(session, url)
                    self._prompts[model] = await asyncio.to_thread(_prompts_from, files, samples, rendering)
                    logger.info("%s: tokenizer read from %s", model, url)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # whatever a replica answers, the gateway serves on without it
                    logger.warning("%s: no tokenizer from %s (%s)", model, url, error)
            self._failed_at[model] = time.monotonic()
        finally:
            del self._fetches[model]


async def _files_of(session: aiohttp.ClientSession, url: str) -> tuple[dict[str, bytes], Any, ChatRendering]:
    """The files a replica serves, by name, its samples' token ids and how it renders chat prompts (the
    defaults where a replica of an older kvfleet does not say); ValueError for an answer that is not what the
    contract says."""
    async with session.get(
        f"{url}{TOKENIZER_FILES_PATH}",
        headers={"Accept-Encoding": "identity"},
        timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S),
    ) as response:
        if response.status != 200:
            raise ValueError(f"it answered {response.status}")
        if (response.content_length or 0) > MAX_ANSWER_BYTES:
            raise ValueError(f"its answer is larger than {MAX_ANSWER_BYTES} bytes")
        body = bytearray()
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > MAX_ANSWER_BYTES:
                raise ValueError(f"its answer is larger than {MAX_ANSWER_BYTES} bytes")
    answer = json.loads(body)
    files = answer.get("files") if isinstance(answer, dict) else None
    if not isinstance(files, dict) or "tokenizer.json" not in files:
        raise ValueError("its answer holds no tokenizer.json")
    try:
        decoded = {
            name: base64.b64decode(data, validate=True)
            for name, data in files.items()
            if name in FILES and isinstance(data, str)
        }
    except binascii.Error as error:
        raise ValueError(f"its answer is not base64: {error}") from None
    rendering = answer.get("chat_rendering")
    return (
        decoded,
        answer.get("samples"),
        DEFAULT_RENDERING if rendering is None else ChatRendering.from_json(rendering),
    )


def _prompts_from(files: Mapping[str, bytes], samples: Any, rendering: ChatRendering) -> ModelPrompts:
    """The files read into memory (the folder is gone once they are), if they tokenize the contract's
    samples as the replica's own tokenizer does; ValueError otherwise."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-") as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        prompts = ModelPrompts(folder, rendering)
    if sample_token_ids(prompts.tokenizer) != samples:
        raise ValueError("its files do not tokenize as its own tokenizer does")
    return prompts
