"""Runs the batches of a BatchStore, oldest first, through whatever answers a line: the server's handlers at
the `batch` tier here, a replica's HTTP API in a gateway.

A line is recorded once it has an answer; one that gets a transient refusal (the queue is full, a higher
tier took its place, the server is draining or loading) is tried again later rather than recorded as failed.
Cancellation and the completion window are checked while lines run, and stop the ones in flight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any

from kvfleet.runtime.batch.lines import Answer, BatchLine, error_record, response_record
from kvfleet.runtime.batch.store import Batch, BatchStore, fault_reason

logger = logging.getLogger(__name__)

# Answers that say "not now" about the server rather than anything about the request: a full queue, a
# higher tier taking the line's place, a server loading or draining, an engine gone (the server exits, and
# its next start runs the line).
_TRANSIENT_STATUSES = frozenset({429, 503})
_ENGINE_DEAD = "engine_dead"
_POLL_S = 0.5
_RETRY_AFTER_S = 1.0
# After a pass a fault stopped: long enough not to flood the log while a disk stays full.
_FAULT_PAUSE_S = 5.0


class BatchWorker:
    def __init__(self, store: BatchStore, answer: Answer, *, width: int) -> None:
        self.store = store
        self.answer = answer
        # Lines in flight at once.
        self.width = width
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A batch was created or cancelled: look now rather than at the next poll."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Runs until cancelled, or until the store cannot even list its batches (its database is broken),
        which its caller must report: a fault of one batch, a full disk included, fails that batch, and
        one that cannot be recorded pauses the worker, which then tries again."""
        while True:
            self._wake.clear()
            faultless = await self._advance_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POLL_S if faultless else _FAULT_PAUSE_S):
                    await self._wake.wait()

    async def _advance_all(self) -> bool:
        """Advances every unfinished batch, oldest first; False if one met a fault that could not even be
        recorded (it is tried again on the next pass)."""
        faultless = True
        for batch in self.store.unfinished_batches():
            try:
                await self._advance(batch)
            except Exception as error:
                # A fault of this batch (its file gone, the disk full) must not stop the others.
                logger.exception("batch %s failed", batch.id)
                faultless = await self._fail(batch, error) and faultless
        return faultless

    async def _fail(self, batch: Batch, error: Exception) -> bool:
        try:
            await asyncio.to_thread(self.store.fail, batch, fault_reason(error))
        except Exception:
            logger.exception("batch %s could not be recorded as failed", batch.id)
            return False
        return True

    async def _advance(self, batch: Batch) -> None:
        """Take the batch as far as it goes now: run its lines, or finish it as it has ended."""
        status = self.store.status(batch.id)
        if status == "cancelling":
            ended = "cancelled"
        elif status == "finalizing":
            ended = "completed"
        elif time.time() >= batch.expires_at:
            ended = "expired"
        else:
            self.store.start(batch.id)
            ended = await self._run_lines(batch) or "completed"
        # Files are written and synced there: off the event loop, which interactive requests share.
        await asyncio.to_thread(self.store.finalize, batch, ended)
        logger.info("batch %s %s", batch.id, ended)

    def _ended(self, batch: Batch) -> str | None:
        """Why the batch must stop now, as the status it ends in; None while it may go on."""
        if self.store.status(batch.id) == "cancelling":
            return "cancelled"
        if time.time() >= batch.expires_at:
            return "expired"
        return None

    async def _run_lines(self, batch: Batch) -> str | None:
        """Answer the lines not answered yet; returns the status the batch ended in early, if it did."""
        answered = self.store.answered_lines(batch.id)
        lines = (
            (number, line)
            for number, line in self.store.input_lines(batch.input_file_id, batch.endpoint)
            if number not in answered
        )
        retries: collections.deque[tuple[int, BatchLine]] = collections.deque()
        in_flight: dict[asyncio.Task[tuple[int, dict[str, Any]]], tuple[int, BatchLine]] = {}
        exhausted = False
        try:
            while True:
                ended = self._ended(batch)
                if ended is not None:
                    return ended
                while len(in_flight) < self.width:
                    if retries:
                        number, line = retries.popleft()
                    else:
                        item = next(lines, None)
                        if item is None:
                            exhausted = True
                            break
                        number, line = item
                    if not isinstance(line, BatchLine):
                        # Checked when the batch was created; a file changed on disk since then lands here.
                        record = error_record(line.custom_id, "invalid_request", str(line))
                        await asyncio.to_thread(self.store.record, batch.id, number, record, failed=True)
                        continue
                    in_flight[asyncio.create_task(self.answer(line.url, line.body))] = (number, line)
                if exhausted and not in_flight and not retries:
                    return None
                if not in_flight:
                    await asyncio.sleep(_RETRY_AFTER_S)
                    continue
                finished, _ = await asyncio.wait(
                    in_flight, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED
                )
                refused = False
                for task in finished:
                    number, line = in_flight.pop(task)
                    status, body = task.result()
                    if _transient(status, body):
                        retries.append((number, line))
                        refused = True
                        continue
                    record = response_record(line.custom_id, status, body)
                    await asyncio.to_thread(self.store.record, batch.id, number, record, failed=status != 200)
                if refused:
                    # The server turned lines away: give it a moment before offering them again.
                    await asyncio.sleep(_RETRY_AFTER_S)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)


def _transient(status: int, body: dict[str, Any]) -> bool:
    error = body.get("error")
    return status in _TRANSIENT_STATUSES or (isinstance(error, dict) and error.get("code") == _ENGINE_DEAD)
