"""OpenAI's Files and Batches routes over a BatchStore (`--batch-store`), and the worker that runs the
batches at the `batch` tier with the server's own handlers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from kvfleet.runtime.batch.answers import answer_line
from kvfleet.runtime.batch.store import BatchApiError, BatchStore, fault_reason
from kvfleet.runtime.batch.worker import BatchWorker
from kvfleet.runtime.server.errors import (
    BadRequestError,
    ConflictError,
    NotFoundError,
    OpenAIError,
    PayloadTooLargeError,
    error_response,
)
from kvfleet.runtime.server.state import ServerState
from kvfleet.runtime.serving.protocol import BatchCreateRequest
from starlette.responses import FileResponse, JSONResponse, Response

logger = logging.getLogger(__name__)

FILES_PATH = "/v1/files"
_ERRORS: dict[str, type[OpenAIError]] = {
    "invalid": BadRequestError,
    "not_found": NotFoundError,
    "too_large": PayloadTooLargeError,
    "conflict": ConflictError,
}
# OpenAI's default page sizes.
_FILES_PAGE = 10000
_BATCHES_PAGE = 20


class BatchService:
    """The store and its worker, for the lifetime of the app."""

    def __init__(self, state: ServerState, store: BatchStore) -> None:
        self.state = state
        self.store = store
        answer = functools.partial(answer_line, state.openai_service())
        # Twice the engine's batch: a line is waiting to take the place of each that finishes.
        self.worker = BatchWorker(store, answer, width=2 * state.engine.config.max_num_seqs)
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        task = asyncio.create_task(self.worker.run_forever())
        task.add_done_callback(self._worker_ended)
        try:
            yield
        finally:
            task.cancel()
            # Waited for, not awaited: a worker that has stopped was reported when it did.
            await asyncio.wait([task])
            self.store.close()

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        """A worker that ends before the app does has met a store it cannot use: /health and /ready say so,
        so that the pod is restarted rather than left holding batches nobody runs."""
        if task.cancelled():
            return
        error = task.exception()
        assert error is not None, "the worker only ends by raising"
        logger.error("the batch worker has stopped", exc_info=error)
        self.state.batch_worker_failure = f"the batch worker has stopped: {fault_reason(error)}"

    def wake_worker(self) -> None:
        """For routes, which run on the thread pool: the worker's event belongs to the event loop."""
        assert self._loop is not None, "routes are served once the app has started"
        self._loop.call_soon_threadsafe(self.worker.wake)


def add_batch_routes(app: FastAPI, service: BatchService) -> None:
    store = service.store
    app.add_exception_handler(BatchApiError, _batch_api_error)

    # Plain `def` routes run on the thread pool: the store reads and writes files and the database.
    @app.post(FILES_PATH)
    def create_file(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> Response:
        return JSONResponse(store.create_file(file.file, file.filename or "batch.jsonl", purpose))

    @app.get(FILES_PATH)
    def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: Annotated[int, Query()] = _FILES_PAGE,
        order: str = "desc",
    ) -> Response:
        return JSONResponse(store.list_files(purpose=purpose, after=after, limit=limit, order=order))

    @app.get(FILES_PATH + "/{file_id}")
    def retrieve_file(file_id: str) -> Response:
        return JSONResponse(store.get_file(file_id))

    @app.get(FILES_PATH + "/{file_id}/content")
    def file_content(file_id: str) -> Response:
        return FileResponse(store.file_path(file_id), media_type="application/octet-stream")

    @app.delete(FILES_PATH + "/{file_id}")
    def delete_file(file_id: str) -> Response:
        return JSONResponse(store.delete_file(file_id))

    @app.post("/v1/batches")
    def create_batch(body: BatchCreateRequest) -> Response:
        batch = store.create_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
        service.wake_worker()
        return JSONResponse(batch)

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: Annotated[int, Query()] = _BATCHES_PAGE) -> Response:
        return JSONResponse(store.list_batches(after=after, limit=limit))

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str) -> Response:
        return JSONResponse(store.get_batch(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> Response:
        batch = store.cancel_batch(batch_id)
        service.wake_worker()
        return JSONResponse(batch)


async def _batch_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BatchApiError)
    return error_response(_ERRORS[exc.kind](exc.message, param=exc.param, code=exc.code))
