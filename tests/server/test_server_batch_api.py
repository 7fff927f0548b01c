"""The Batch API through the official openai SDK against real `kvfleet serve` processes: upload, create,
poll, download; refusals; cancel; expiry; a server killed mid-batch and restarted on the same store."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import openai
import pytest
from kvfleet.runtime.batch.store import BatchStore
from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.server.batch_routes import BatchService
from kvfleet.runtime.server.state import ServerSettings, ServerState

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
POLL_TIMEOUT_S = 300
MAX_FILE_BYTES = 256 << 10
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def batch_server(start_server: Callable[..., ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Any:
    store = tmp_path_factory.mktemp("batch-store")
    # A narrow batch: the long batches of the cancel and expiry tests take many waves, so that they are
    # still running when cancelled or when their window closes.
    args = (
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "4",
        "--max-batch-file-bytes",
        str(MAX_FILE_BYTES),
    )
    return start_server(*args, "--batch-store", str(store))


@pytest.fixture(scope="module")
def client(batch_server: ServerProcess) -> openai.OpenAI:
    return client_of(batch_server)


def request_line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch").id


def completion_lines(count: int, max_tokens: int) -> list[dict[str, Any]]:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [
        request_line(f"line-{index}", "/v1/completions", {"prompt": f"Story {index}:", **body})
        for index in range(count)
    ]


def wait_for(client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool]) -> Any:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)


def records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_to_completion_with_the_answers_of_the_live_routes(client: openai.OpenAI) -> None:
    greedy = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    conversations = [[{"role": "user", "content": f"Question {index}?"}] for index in range(6)]
    lines = [
        request_line(f"chat-{index}", "/v1/chat/completions", {"messages": messages, **greedy})
        for index, messages in enumerate(conversations)
    ]
    lines.append(request_line("wrong-model", "/v1/chat/completions", {**lines[0]["body"], "model": "other"}))
    lines.append(request_line("bad-n", "/v1/chat/completions", {**lines[0]["body"], "n": 0}))
    file_id = upload(client, lines)
    uploaded = client.files.retrieve(file_id)
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "batch",
        len(jsonl(lines)),
        "requests.jsonl",
    )
    assert file_id in [file.id for file in client.files.list(purpose="batch")]
    assert client.files.content(file_id).content == jsonl(lines)

    created = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"team": "search"},
    )
    assert created.status in ("validating", "in_progress")
    assert created.metadata == {"team": "search"}
    assert created.expires_at - created.created_at == 24 * 3600

    batch = wait_for(client, created.id, lambda batch: batch.status in TERMINAL)

    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 6, "failed": 2}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    answered = {record["custom_id"]: record for record in records(client, batch.output_file_id)}
    assert set(answered) == {f"chat-{index}" for index in range(6)}
    for index, messages in enumerate(conversations):
        response = answered[f"chat-{index}"]["response"]
        assert response["status_code"] == 200
        live = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        body = response["body"]
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert body["usage"]["completion_tokens"] == 5
    failed = {record["custom_id"]: record["response"] for record in records(client, batch.error_file_id)}
    assert failed["wrong-model"]["status_code"] == 404
    assert failed["wrong-model"]["body"]["error"]["code"] == "model_not_found"
    assert failed["bad-n"]["status_code"] == 400
    assert failed["bad-n"]["body"]["error"]["param"] == "n"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert created.id in [listed.id for listed in client.batches.list()]

    with pytest.raises(openai.ConflictError, match="completed"):
        client.batches.cancel(batch.id)
    assert client.files.delete(batch.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.output_file_id)


def test_bad_requests_get_clear_4xx(client: openai.OpenAI) -> None:
    good = completion_lines(1, 2)
    with pytest.raises(openai.BadRequestError, match="purpose") as refused:
        client.files.create(file=("x.jsonl", jsonl(good)), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError, match="line 2 of the file: the line is not valid JSON"):
        client.files.create(file=("x.jsonl", jsonl([*good, "{oops"])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="repeated"):
        client.files.create(file=("x.jsonl", jsonl(good + good)), purpose="batch")
    oversize = completion_lines(1 + MAX_FILE_BYTES // len(jsonl(good)), 2)
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("x.jsonl", jsonl(oversize)), purpose="batch")
    assert too_large.value.status_code == 413
    assert str(MAX_FILE_BYTES) in too_large.value.message

    with pytest.raises(openai.NotFoundError, match="file-nope"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    file_id = upload(client, good)
    with pytest.raises(openai.BadRequestError, match="not the batch's endpoint"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="soon")
    # These three were 500s.
    with pytest.raises(openai.BadRequestError, match="at most 24h"):
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="99999999999999999999d"
        )
    with pytest.raises(openai.BadRequestError, match="at most 16 pairs"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={f"key{index}": "value" for index in range(17)},
        )
    nested = jsonl([request_line("deep", "/v1/completions", {"model": MODEL_NAME, "user": "<deep>"})])
    nested = nested.replace(b'"<deep>"', b"[" * 5000 + b"]" * 5000)
    with pytest.raises(openai.BadRequestError, match=r"line 2 of the file: .* nests deeper than 64 levels"):
        client.files.create(file=("x.jsonl", jsonl(good) + nested), purpose="batch")
    for call in (client.batches.retrieve, client.batches.cancel, client.files.retrieve, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call("batch_unknown")


def partition(client: openai.OpenAI, batch: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return records(client, batch.output_file_id), records(client, batch.error_file_id)


def test_cancel_stops_a_running_batch_and_accounts_for_every_line(client: openai.OpenAI) -> None:
    lines = completion_lines(200, 48)
    input_file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=input_file_id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_for(client, batch.id, lambda batch: batch.request_counts.completed >= 1)
    with pytest.raises(openai.ConflictError, match=batch.id):
        client.files.delete(input_file_id)

    cancelling = client.batches.cancel(batch.id)

    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for(client, batch.id, lambda batch: batch.status in TERMINAL)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    answered, errors = partition(client, cancelled)
    assert 1 <= len(answered) < len(lines)
    assert sorted(r["custom_id"] for r in answered + errors) == sorted(line["custom_id"] for line in lines)
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_completion_window_expires(client: openai.OpenAI) -> None:
    lines = completion_lines(400, 64)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="2s"
    )

    expired = wait_for(client, batch.id, lambda batch: batch.status in TERMINAL)

    assert expired.status == "expired" and expired.expired_at
    answered, errors = partition(client, expired)
    assert len(answered) < len(lines)
    assert sorted(r["custom_id"] for r in answered + errors) == sorted(line["custom_id"] for line in lines)
    assert {r["error"]["code"] for r in errors} == {"batch_expired"}


def test_a_killed_server_resumes_the_batch_and_answers_every_line_once(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    # A narrow batch, so that the lines finish in many waves and the kill lands between them.
    args = ("--scheduling-policy", "priority", "--max-num-seqs", "2", "--batch-store", str(store))
    first = start_server(*args)
    client = client_of(first)
    lines = completion_lines(150, 32)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
    )
    before = wait_for(client, batch.id, lambda batch: batch.request_counts.completed >= 10)
    assert before.status == "in_progress"

    os.kill(first.pid, signal.SIGKILL)
    first.process.wait()
    second = start_server(*args)
    client = client_of(second)

    resumed = client.batches.retrieve(batch.id)
    assert resumed.request_counts.completed >= 10
    done = wait_for(client, batch.id, lambda batch: batch.status in TERMINAL)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 150, "completed": 150, "failed": 0}
    answered = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in answered) == sorted(line["custom_id"] for line in lines)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 32 for r in answered)
    assert done.error_file_id is None


def test_a_worker_that_cannot_read_its_store_fails_the_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker used to die with /health and /ready still answering OK, and batches stayed validating.
    engine = SimpleNamespace(
        ready=True, is_sleeping=False, error=None, config=SimpleNamespace(max_num_seqs=2)
    )
    state = ServerState(ServerSettings(MODEL_NAME), engine, ServerMetrics(MODEL_NAME))  # type: ignore[arg-type]
    store = BatchStore(tmp_path)
    service = BatchService(state, store)

    def unreadable() -> list[Any]:
        raise sqlite3.DatabaseError("disk I/O error")

    monkeypatch.setattr(store, "unfinished_batches", unreadable)

    async def run() -> None:
        async with service.running():
            deadline = time.monotonic() + 10
            while state.ready:
                assert time.monotonic() < deadline, "the server stayed ready"
                await asyncio.sleep(0.01)

    asyncio.run(run())
    assert state.failure == "the batch worker has stopped: storage error: disk I/O error"
    assert state.not_ready_reason() == state.failure
