"""The Batch API's store and worker on a disk that fails: a batch whose files cannot be written fails with the
reason and the worker goes on; a full disk pauses the worker, a delete frees room through the API, and the
batches then run; quotas and OpenAI's limits refuse what would fill the store. In process, with a fake
answer for each line, so that the faults are injected where the store writes (its files and its database)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import io
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from kvfleet.runtime.batch.store import BatchApiError, BatchStore
from kvfleet.runtime.batch.worker import BatchWorker

WAIT_S = 20.0


class Disk:
    """The store's disk. Full when the files on it reach `capacity`: file writes then fail with ENOSPC and
    the database's with SQLite's "database or disk is full"; deleting a file makes room. `broken`: file
    writes fail with that errno whatever the room."""

    def __init__(self, files_dir: Path) -> None:
        self.files_dir = files_dir
        self.capacity = math.inf
        self.broken: int | None = None

    def used(self) -> int:
        """The size of the files on it, which the batch worker's thread may be removing meanwhile."""
        total = 0
        for path in self.files_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    @property
    def full(self) -> bool:
        return self.used() >= self.capacity

    def fill(self) -> None:
        self.capacity = self.used()

    def check_write(self, size: int) -> None:
        if self.broken is not None:
            raise OSError(self.broken, "injected")
        if self.used() + size > self.capacity:
            raise OSError(errno.ENOSPC, "injected")


class DiskFile:
    """A file opened for writing on the Disk."""

    def __init__(self, handle: IO[bytes], disk: Disk) -> None:
        self.handle, self.disk = handle, disk

    def __enter__(self) -> DiskFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.close()

    def write(self, data: bytes) -> int:
        self.disk.check_write(len(data))
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Disk:
    root = tmp_path / "store"
    (root / "files").mkdir(parents=True)
    disk = Disk(root / "files")
    real_open = Path.open

    def open_on_disk(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(path, mode, *args, **kwargs)
        if path.is_relative_to(root) and any(flag in mode for flag in "wa+"):
            return DiskFile(handle, disk)
        return handle

    class DiskConnection(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
            if disk.full and sql.lstrip().startswith(("INSERT", "UPDATE", "DELETE")):
                raise sqlite3.OperationalError("database or disk is full")
            return super().execute(sql, *args)

    monkeypatch.setattr(Path, "open", open_on_disk)
    monkeypatch.setattr(sqlite3, "connect", functools.partial(sqlite3.connect, factory=DiskConnection))
    return disk


@pytest.fixture
def store(disk: Disk) -> Iterator[BatchStore]:
    store = BatchStore(disk.files_dir.parent)
    yield store
    store.close()


def request_lines(count: int, tag: str = "line") -> bytes:
    lines = [
        {
            "custom_id": f"{tag}-{index}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"{tag} {index}"},
        }
        for index in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(store: BatchStore, data: bytes) -> str:
    return store.create_file(io.BytesIO(data), "requests.jsonl", "batch")["id"]


async def echo(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    await asyncio.sleep(0)
    return 200, {"id": f"cmpl-{body['prompt']}", "choices": [{"text": body["prompt"]}]}


async def wait_for_status(store: BatchStore, batch_id: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while (batch := store.get_batch(batch_id))["status"] not in statuses:
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.02)
    return batch


def answers(store: BatchStore, batch: dict[str, Any]) -> list[str]:
    lines = store.file_path(batch["output_file_id"]).read_text().splitlines()
    return sorted(json.loads(line)["response"]["body"]["choices"][0]["text"] for line in lines)


def run_worker(store: BatchStore) -> tuple[BatchWorker, asyncio.Task[None]]:
    worker = BatchWorker(store, echo, width=4)
    return worker, asyncio.create_task(worker.run_forever())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("fault", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
def test_a_batch_whose_files_cannot_be_written_fails_with_the_reason_and_the_next_one_runs(
    store: BatchStore, disk: Disk, fault: int
) -> None:
    async def scenario() -> None:
        input_file_id = upload(store, request_lines(3))
        disk.broken = fault
        _, task = run_worker(store)
        failed = store.create_batch(input_file_id, "/v1/completions", "24h", None)
        failed = await wait_for_status(store, failed["id"], {"failed", "completed"})
        left = sorted(path.name for path in disk.files_dir.iterdir())
        disk.broken = None
        beside = store.create_batch(input_file_id, "/v1/completions", "24h", None)
        beside = await wait_for_status(store, beside["id"], {"failed", "completed"})
        assert not task.done()
        await stop(task)

        assert failed["status"] == "failed" and failed["failed_at"]
        [error] = failed["errors"]["data"]
        assert error["message"] == f"storage error: {os.strerror(fault)}"
        assert str(disk.files_dir) not in error["message"]
        # What the fault let through takes no room.
        assert left == [input_file_id]
        assert beside["status"] == "completed"
        assert beside["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert answers(store, beside) == ["line 0", "line 1", "line 2"]

    asyncio.run(scenario())


def test_on_a_full_disk_a_delete_makes_room_and_the_batches_then_run(store: BatchStore, disk: Disk) -> None:
    async def scenario() -> None:
        filler = upload(store, request_lines(40, "filler"))
        input_file_id = upload(store, request_lines(3))
        waiting = store.create_batch(input_file_id, "/v1/completions", "24h", None)
        disk.fill()
        worker, task = run_worker(store)
        await asyncio.sleep(0.3)
        assert store.get_batch(waiting["id"])["status"] == "validating"

        # The delete needs no new room: the bytes go before the row.
        assert store.delete_file(filler)["deleted"]
        with pytest.raises(BatchApiError, match="no file"):
            store.get_file(filler)
        assert not disk.full
        later = store.create_batch(input_file_id, "/v1/completions", "24h", None)
        worker.wake()
        done = [
            await wait_for_status(store, batch["id"], {"completed", "failed"}) for batch in (waiting, later)
        ]
        assert not task.done()
        await stop(task)

        for batch in done:
            assert batch["status"] == "completed", batch
            assert answers(store, batch) == ["line 0", "line 1", "line 2"]

    asyncio.run(scenario())


def test_uploads_past_the_quotas_are_refused_until_files_are_deleted(tmp_path: Path) -> None:
    store = BatchStore(tmp_path, max_files=4, max_store_bytes=64 << 10)
    small = request_lines(2)
    kept = [upload(store, small) for _ in range(4)]
    with pytest.raises(BatchApiError, match="4 uploaded files") as refused:
        upload(store, small)
    assert refused.value.code == "file_quota_exceeded"
    store.delete_file(kept.pop())
    kept.append(upload(store, small))

    for file_id in kept:
        store.delete_file(file_id)
    big = request_lines(400)
    assert len(big) > store.max_store_bytes // 2
    upload(store, big)
    with pytest.raises(BatchApiError, match="limit of 65536 bytes") as refused:
        upload(store, big)
    assert refused.value.code == "storage_quota_exceeded"
    assert len(list(store.files_dir.iterdir())) == 1
    store.close()


def test_metadata_and_completion_window_follow_openais_limits(store: BatchStore) -> None:
    file_id = upload(store, request_lines(1))
    create = functools.partial(store.create_batch, file_id, "/v1/completions")
    widest = {f"k{index}".ljust(64, "k"): "v" * 512 for index in range(16)}
    assert create("24h", widest)["metadata"] == widest
    for metadata, message in [
        ({f"k{index}": "v" for index in range(17)}, "at most 16 pairs"),
        ({"k" * 65: "v"}, "keys may be at most 64"),
        ({"k": "v" * 513}, "values may be at most 512"),
    ]:
        with pytest.raises(BatchApiError, match=message) as refused:
            create("24h", metadata)
        assert refused.value.param == "metadata"
    for window in ("99999999999999999999d", "25h", "2d", "0s", "1" * 5000 + "s"):
        with pytest.raises(BatchApiError, match="at most 24h") as refused:
            create(window, None)
        assert refused.value.param == "completion_window"
    assert create("90s", None)["expires_at"] - int(time.time()) <= 90
