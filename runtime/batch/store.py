"""The OpenAI Batch API's state: files and batches in an embedded SQLite database, file bytes in a folder.

Knows nothing of HTTP: a server (or a gateway spreading batches over replicas) maps its calls to routes and
its BatchApiError to status codes. Every answered line is a row keyed by (batch, line number), committed
on its own as soon as it is answered, so a crash at any point loses only the lines in flight and never
records one twice; the output and error files are written from those rows when the batch ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvfleet.runtime.batch.lines import (
    SUPPORTED_URLS,
    BatchLine,
    MalformedLineError,
    error_record,
    parse_line,
    record_line,
)

# OpenAI's limit on a batch input file.
DEFAULT_MAX_BATCH_FILE_BYTES = 200 << 20
# Uploads the store keeps at once (OpenAI's largest page of files, so one page lists them all), and the bytes
# of every file it holds, outputs included (OpenAI's 100 GB for an organization's files): a full disk would
# stop every batch, and these keep clients from filling it.
DEFAULT_MAX_BATCH_FILES = 10000
DEFAULT_MAX_BATCH_STORE_BYTES = 100 << 30
BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# Statuses of a batch whose lines may still be answered.
RUNNABLE = ("validating", "in_progress")
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI's one window; shorter ones are kvfleet's, for batches that must finish sooner.
MAX_WINDOW_S = 24 * 3600
# OpenAI's limits on a batch's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
_COPY_CHUNK_BYTES = 1 << 20
# OpenAI allows up to 10000 files per page.
_LIST_LIMIT = (1, 10000)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    total INTEGER NOT NULL,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""


class BatchApiError(Exception):
    """A request the Batch API refuses; `kind` is what went wrong, which a server maps to its status."""

    kind = "invalid"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BatchNotFoundError(BatchApiError):
    kind = "not_found"


class BatchFileTooLargeError(BatchApiError):
    kind = "too_large"


class BatchConflictError(BatchApiError):
    """The object is in a state that does not allow the operation (cancel a finished batch, ...)."""

    kind = "conflict"


def window_seconds(completion_window: str) -> int:
    match = _WINDOW.match(completion_window)
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)] if match is not None else None
    if seconds is None or seconds > MAX_WINDOW_S:
        raise BatchApiError(
            f"completion_window must be a duration of at most 24h, like 24h, 30m or 90s, "
            f"got {completion_window!r}",
            param="completion_window",
        )
    return seconds


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's rule for a batch's metadata: up to 16 pairs of text, keys up to 64 characters and values up
    to 512."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BatchApiError(
            f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", param="metadata"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BatchApiError("metadata keys and values must be strings", param="metadata")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise BatchApiError(
                f"metadata keys may be at most {MAX_METADATA_KEY_CHARS} characters long", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise BatchApiError(
                f"metadata values may be at most {MAX_METADATA_VALUE_CHARS} characters long (that of "
                f"{key!r} has {len(value)})",
                param="metadata",
            )


def fault_reason(error: BaseException) -> str:
    """What a batch's errors say of the fault that failed it: the storage's own words (never a path), or
    only the kind of an unexpected error."""
    if isinstance(error, OSError) and error.errno is not None:
        return f"storage error: {os.strerror(error.errno)}"
    if isinstance(error, sqlite3.Error):
        return f"storage error: {error}"
    return f"internal error: {type(error).__name__}"


@dataclass(frozen=True)
class Batch:
    """What the worker needs of a batch."""

    id: str
    endpoint: str
    input_file_id: str
    status: str
    expires_at: int


class BatchStore:
    """Thread-safe: the routes may call it from a thread pool while the worker runs on the event loop."""

    def __init__(
        self,
        root: Path,
        *,
        max_file_bytes: int = DEFAULT_MAX_BATCH_FILE_BYTES,
        max_files: int = DEFAULT_MAX_BATCH_FILES,
        max_store_bytes: int = DEFAULT_MAX_BATCH_STORE_BYTES,
    ) -> None:
        self.root = root
        self.files_dir = root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.max_store_bytes = max_store_bytes
        self._lock = threading.Lock()
        self._db = sqlite3.connect(root / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # Every commit reaches the disk before it returns: a recorded answer survives a power cut too.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- files -----------------------------------------------------------------------------------

    def create_file(self, source: IO[bytes], filename: str, purpose: str) -> dict[str, Any]:
        """Store an upload of purpose `batch` once every line of it is a batch request."""
        if purpose != BATCH_PURPOSE:
            raise BatchApiError(
                f"purpose must be {BATCH_PURPOSE!r} (this server stores batch input files only), "
                f"got {purpose!r}",
                param="purpose",
            )
        file_id = _new_id("file")
        partial = self.files_dir / f"{file_id}.uploading"
        try:
            # Checked before the copy, which may then take only the room left, and again as the file is
            # recorded, since uploads run side by side.
            with self._transaction() as db:
                room = self._room(db)
            size = self._copy_limited(source, partial, room)
            _check_batch_input(partial)
            with self._transaction() as db:
                if size > self._room(db):
                    raise self._store_full()
                db.execute(
                    "INSERT INTO files VALUES (?, ?, ?, ?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM files))",
                    (file_id, filename, purpose, size, int(time.time())),
                )
                os.replace(partial, self.files_dir / file_id)
        finally:
            partial.unlink(missing_ok=True)
        return self.get_file(file_id)

    def _room(self, db: sqlite3.Connection) -> int:
        """The bytes an upload may bring; refused at once when the store holds its most uploads or bytes.
        Outputs count as bytes, not as uploads: the worker always writes them."""
        uploads, used = db.execute(
            "SELECT COUNT(*) FILTER (WHERE purpose = ?), COALESCE(SUM(bytes), 0) FROM files", (BATCH_PURPOSE,)
        ).fetchone()
        if uploads >= self.max_files:
            raise BatchApiError(
                f"the store holds {uploads} uploaded files, its limit; delete some to upload more",
                param="file",
                code="file_quota_exceeded",
            )
        if used >= self.max_store_bytes:
            raise self._store_full()
        return self.max_store_bytes - used

    def _store_full(self) -> BatchApiError:
        return BatchApiError(
            f"the store's files would pass its limit of {self.max_store_bytes} bytes; "
            "delete some to upload more",
            param="file",
            code="storage_quota_exceeded",
        )

    def _copy_limited(self, source: IO[bytes], destination: Path, room: int) -> int:
        size = 0
        with destination.open("wb") as target:
            while chunk := source.read(_COPY_CHUNK_BYTES):
                size += len(chunk)
                if size > self.max_file_bytes:
                    raise BatchFileTooLargeError(
                        f"the file is larger than this server's limit of {self.max_file_bytes} bytes",
                        param="file",
                        code="file_too_large",
                    )
                if size > room:
                    raise self._store_full()
                target.write(chunk)
            target.flush()
            os.fsync(target.fileno())
        return size

    def get_file(self, file_id: str) -> dict[str, Any]:
        rows = self._query("SELECT * FROM files WHERE id = ?", (file_id,))
        if not rows:
            raise BatchNotFoundError(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return _file_object(rows[0])

    def file_path(self, file_id: str) -> Path:
        self.get_file(file_id)
        path = self.files_dir / file_id
        if not path.exists():
            # A delete that removed the bytes and could not record it (see delete_file).
            raise BatchNotFoundError(
                f"file {file_id} has been deleted", param="file_id", code="file_not_found"
            )
        return path

    def list_files(self, *, purpose: str | None, after: str | None, limit: int, order: str) -> dict[str, Any]:
        clause, args = ("WHERE purpose = ?", (purpose,)) if purpose else ("", ())
        rows = self._query(f"SELECT * FROM files {clause} ORDER BY seq", args)
        return _page([_file_object(row) for row in rows], after=after, limit=limit, order=order)

    def delete_file(self, file_id: str) -> dict[str, Any]:
        with self._transaction() as db:
            if not db.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchall():
                raise BatchNotFoundError(
                    f"no file with id {file_id!r}", param="file_id", code="file_not_found"
                )
            using = db.execute(
                "SELECT id FROM batches WHERE input_file_id = ? AND status NOT IN (?, ?, ?, ?)",
                (file_id, *TERMINAL),
            ).fetchall()
            if using:
                raise BatchConflictError(
                    f"the file is the input of batch {using[0]['id']}, which has not finished",
                    param="file_id",
                )
            # The bytes go first: on a full disk, recording the delete needs the room they leave.
            (self.files_dir / file_id).unlink(missing_ok=True)
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches ---------------------------------------------------------------------------------

    def create_batch(
        self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        """A batch of the file's lines, each of which must call `endpoint`; it starts as validating."""
        if endpoint not in SUPPORTED_URLS:
            raise BatchApiError(
                f"endpoint must be one of {', '.join(SUPPORTED_URLS)}, got {endpoint!r}", param="endpoint"
            )
        window = window_seconds(completion_window)
        check_metadata(metadata)
        file = self.get_file(input_file_id)
        if file["purpose"] != BATCH_PURPOSE:
            raise BatchApiError(
                f"file {input_file_id} has purpose {file['purpose']!r}, not {BATCH_PURPOSE!r}",
                param="input_file_id",
            )
        total = 0
        for _, line in self.input_lines(input_file_id, endpoint):
            if isinstance(line, MalformedLineError):
                raise BatchApiError(f"line {total + 1} of the input file: {line}", param="input_file_id")
            total += 1
        batch_id = _new_id("batch")
        now = int(time.time())
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, total,"
                " metadata, created_at, expires_at, seq) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?,"
                " (SELECT COALESCE(MAX(seq), 0) + 1 FROM batches))",
                (
                    batch_id,
                    endpoint,
                    input_file_id,
                    completion_window,
                    total,
                    json.dumps(metadata) if metadata is not None else None,
                    now,
                    now + window,
                ),
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        rows = self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))
        if not rows:
            raise BatchNotFoundError(
                f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found"
            )
        return self._batch_object(rows[0])

    def list_batches(self, *, after: str | None, limit: int) -> dict[str, Any]:
        rows = self._query("SELECT * FROM batches ORDER BY seq")
        return _page([self._batch_object(row) for row in rows], after=after, limit=limit, order="desc")

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        with self._transaction() as db:
            rows = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchall()
            if not rows:
                raise BatchNotFoundError(
                    f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found"
                )
            status = rows[0]["status"]
            if status in RUNNABLE:
                db.execute(
                    "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                    (int(time.time()), batch_id),
                )
            elif status != "cancelling":
                raise BatchConflictError(
                    f"batch {batch_id} is {status} and can no longer be cancelled", param="batch_id"
                )
        return self.get_batch(batch_id)

    def _batch_object(self, row: sqlite3.Row) -> dict[str, Any]:
        counts = dict.fromkeys((0, 1), 0)
        for count in self._query(
            "SELECT failed, COUNT(*) AS n FROM results WHERE batch_id = ? GROUP BY failed", (row["id"],)
        ):
            counts[count["failed"]] = count["n"]
        return {
            "id": row["id"],
            "object": "batch",
            "endpoint": row["endpoint"],
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"],
            "status": row["status"],
            "output_file_id": row["output_file_id"],
            "error_file_id": row["error_file_id"],
            "created_at": row["created_at"],
            "in_progress_at": row["in_progress_at"],
            "expires_at": row["expires_at"],
            "finalizing_at": row["finalizing_at"],
            "completed_at": row["completed_at"],
            "failed_at": row["failed_at"],
            "expired_at": row["expired_at"],
            "cancelling_at": row["cancelling_at"],
            "cancelled_at": row["cancelled_at"],
            "request_counts": {"total": row["total"], "completed": counts[0], "failed": counts[1]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        }

    # ---- the worker's side -----------------------------------------------------------------------

    def unfinished_batches(self) -> list[Batch]:
        """Batches not yet in a final status, oldest first."""
        rows = self._query(
            "SELECT id, endpoint, input_file_id, status, expires_at FROM batches "
            "WHERE status NOT IN (?, ?, ?, ?) ORDER BY seq",
            tuple(TERMINAL),
        )
        return [Batch(**dict(row)) for row in rows]

    def status(self, batch_id: str) -> str:
        return self._query("SELECT status FROM batches WHERE id = ?", (batch_id,))[0]["status"]

    def start(self, batch_id: str) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ? "
                "WHERE id = ? AND status = 'validating'",
                (int(time.time()), batch_id),
            )

    def answered_lines(self, batch_id: str) -> set[int]:
        return {
            row["line"] for row in self._query("SELECT line FROM results WHERE batch_id = ?", (batch_id,))
        }

    def input_lines(
        self, input_file_id: str, endpoint: str
    ) -> Iterator[tuple[int, BatchLine | MalformedLineError]]:
        """(line number, request or why it is not one) of each non-blank line of an input file."""
        with (self.files_dir / input_file_id).open("rb") as lines:
            number = 0
            for text in lines:
                if not text.strip():
                    continue
                try:
                    yield number, parse_line(text, endpoint=endpoint)
                except MalformedLineError as exc:
                    yield number, exc
                number += 1

    def record(self, batch_id: str, line: int, record: dict[str, Any], *, failed: bool) -> None:
        """A line's answer, once: a line answered again after a crash keeps its first record."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                (batch_id, line, int(failed), json.dumps(record, ensure_ascii=False)),
            )

    def finalize(self, batch: Batch, final_status: str) -> None:
        """Write the output and error files and move the batch to `final_status`. Lines not answered (a
        cancelled or expired batch) go to the error file, so that every input line is in exactly one of
        them. Safe to repeat after a crash: the files' ids follow from the batch's."""
        now = int(time.time())
        if final_status == "completed":
            with self._transaction() as db:
                db.execute(
                    "UPDATE batches SET status = 'finalizing', finalizing_at = COALESCE(finalizing_at, ?) "
                    "WHERE id = ?",
                    (now, batch.id),
                )
        answered = {
            row["line"]: (row["failed"], row["record"])
            for row in self._query("SELECT line, failed, record FROM results WHERE batch_id = ?", (batch.id,))
        }
        suffix = batch.id.removeprefix("batch_")
        output_id, error_id = f"file-output-{suffix}", f"file-errors-{suffix}"
        try:
            written = self._write_results(batch, final_status, answered, output_id, error_id)
            with self._transaction() as db:
                kept = [file_id for file_id in (output_id, error_id) if written[file_id]]
                for file_id in kept:
                    db.execute(
                        "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?,"
                        " (SELECT COALESCE(MAX(seq), 0) + 1 FROM files))",
                        (
                            file_id,
                            f"{batch.id}_{'output' if file_id == output_id else 'error'}.jsonl",
                            OUTPUT_PURPOSE,
                            (self.files_dir / file_id).stat().st_size,
                            now,
                        ),
                    )
                db.execute(
                    f"UPDATE batches SET status = ?, {final_status}_at = ?, output_file_id = ?,"
                    " error_file_id = ? WHERE id = ?",
                    (
                        final_status,
                        now,
                        output_id if written[output_id] else None,
                        error_id if written[error_id] else None,
                        batch.id,
                    ),
                )
        except BaseException:
            # Nothing of a finalize that failed stays: on a full disk, the room is what the next batch needs.
            for file_id in (output_id, error_id):
                for path in (self.files_dir / file_id, self.files_dir / f"{file_id}.writing"):
                    path.unlink(missing_ok=True)
            raise
        for file_id in (output_id, error_id):
            if not written[file_id]:
                (self.files_dir / file_id).unlink(missing_ok=True)

    def _write_results(
        self,
        batch: Batch,
        final_status: str,
        answered: dict[int, tuple[int, str]],
        output_id: str,
        error_id: str,
    ) -> dict[str, int]:
        """Writes the output and error files whole, each synced before it takes its name; how many lines
        each got."""
        unanswered_code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(final_status)
        written = {output_id: 0, error_id: 0}
        with (
            (self.files_dir / f"{output_id}.writing").open("wb") as output,
            (self.files_dir / f"{error_id}.writing").open("wb") as errors,
        ):
            for number, line in self.input_lines(batch.input_file_id, batch.endpoint):
                if number in answered:
                    failed, text = answered[number]
                    data = text.encode() + b"\n"
                else:
                    failed = True
                    message = f"the batch was {final_status} before this request ran"
                    data = record_line(
                        error_record(line.custom_id, unanswered_code or "batch_failed", message)
                    )
                (errors if failed else output).write(data)
                written[error_id if failed else output_id] += 1
            for handle in (output, errors):
                handle.flush()
                os.fsync(handle.fileno())
        for file_id in (output_id, error_id):
            os.replace(self.files_dir / f"{file_id}.writing", self.files_dir / file_id)
        return written

    def fail(self, batch: Batch, reason: str) -> None:
        """Ends a batch that met a fault of its own (its input file gone, the disk full) as failed, `reason`
        in its errors, with its output and error files where they can still be written. Raises when the
        database cannot be written either."""
        errors = {
            "object": "list",
            "data": [{"code": "batch_failed", "message": reason, "param": None, "line": None}],
        }
        with self._transaction() as db:
            db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch.id))
        try:
            self.finalize(batch, "failed")
        except (OSError, sqlite3.Error):
            with self._transaction() as db:
                db.execute(
                    "UPDATE batches SET status = 'failed', failed_at = ? WHERE id = ?",
                    (int(time.time()), batch.id),
                )


def _check_batch_input(path: Path) -> None:
    """Every line a batch request with its own custom_id, and at least one line: a 400 naming the first
    line that is not."""
    seen: set[str] = set()
    number = 0
    with path.open("rb") as lines:
        for text in lines:
            if not text.strip():
                continue
            number += 1
            try:
                line = parse_line(text)
            except MalformedLineError as exc:
                raise BatchApiError(f"line {number} of the file: {exc}", param="file") from None
            if line.custom_id in seen:
                raise BatchApiError(
                    f"line {number} of the file: custom_id {line.custom_id!r} is repeated", param="file"
                )
            seen.add(line.custom_id)
    if number == 0:
        raise BatchApiError("the file holds no requests", param="file")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}" if prefix == "batch" else f"{prefix}-{secrets.token_hex(12)}"


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def _page(items: list[dict[str, Any]], *, after: str | None, limit: int, order: str) -> dict[str, Any]:
    """One page of a list, OpenAI's cursor pagination: `after` is the id of the previous page's last item."""
    low, high = _LIST_LIMIT
    if not low <= limit <= high:
        raise BatchApiError(f"limit must be in [{low}, {high}], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise BatchApiError(f"order must be asc or desc, got {order!r}", param="order")
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BatchNotFoundError(f"no object with id {after!r} to list after", param="after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
