"""vLLM's --enable-log-outputs: what each sequence generated (a stream's after its output checks), its text
and finish reason at INFO once it finishes and its token ids at DEBUG, both cut to --max-log-len; with
--enable-log-deltas (vLLM's default), a stream's every delta too."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from kvfleet.runtime.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


async def logged_outputs(
    outputs: AsyncIterator[RequestOutput], *, streamed: bool, deltas: bool, max_log_len: int | None
) -> AsyncIterator[RequestOutput]:
    """`outputs`, each sequence's logged on the way."""
    texts: dict[tuple[str, int], str] = {}
    token_ids: dict[tuple[str, int], list[int]] = {}
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            for completion in output.outputs:
                key = (output.request_id, completion.index)
                texts[key] = texts.get(key, "") + completion.text
                token_ids.setdefault(key, []).extend(completion.token_ids)
                # A continuation's first output is what another replica generated: logged with the whole.
                if streamed and deltas and not output.resumed and completion.token_ids:
                    _log(
                        key,
                        completion.text,
                        completion.token_ids,
                        completion.finish_reason,
                        " (delta)",
                        max_log_len,
                    )
                if completion.finished:
                    end = " (stream complete)" if streamed else ""
                    _log(key, texts.pop(key), token_ids.pop(key), completion.finish_reason, end, max_log_len)
            yield output


def _log(
    key: tuple[str, int],
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    part: str,
    max_log_len: int | None,
) -> None:
    request_id, index = key
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "Generated response %s choice %d%s: output_token_ids: %s",
            request_id,
            index,
            part,
            token_ids[:max_log_len],
        )
    logger.info(
        "Generated response %s choice %d%s: output: %r, finish_reason: %s",
        request_id,
        index,
        part,
        text[:max_log_len],
        finish_reason,
    )
