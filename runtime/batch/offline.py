"""`kvfleet run-batch`: a file of requests through the offline engine, answers into an output file.

Inputs are OpenAI batch JSONL, or CSV and Parquet tables with a `prompt` or `messages` column (the other
columns named like request fields are the row's sampling parameters). Rows stream from the file and through
the engine at full batch width; each answer is appended to the output as it finishes, in one write, so a run
killed at any point loses only the rows in flight, and a rerun with the same output skips what it holds.

JSONL input gets OpenAI's batch output lines, one per input line, in the order they finished. A table gets
the same table back with output columns added; until it is complete, its answers collect in a journal next to
it (`OUT.partial`), and the table is written in input order when the last row is answered.
"""

from __future__ import annotations

import asyncio
import csv
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvfleet.runtime import json_depth
from kvfleet.runtime.batch.lines import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    Answer,
    BatchLine,
    MalformedLineError,
    error_record,
    parse_line,
    record_failed,
    record_line,
    response_record,
)

if TYPE_CHECKING:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine

InputFormat = Literal["jsonl", "csv", "parquet"]
INPUT_FORMATS: tuple[InputFormat, ...] = ("jsonl", "csv", "parquet")
_SUFFIXES: dict[str, InputFormat] = {
    ".jsonl": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
# What a table's output gains: the first choice's text and finish reason, token counts, or the error.
OUTPUT_COLUMNS = ("output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error")
_PROMPT, _MESSAGES = "prompt", "messages"
_PARQUET_BATCH_ROWS = 1024


def input_format_of(path: Path, given: str | None) -> InputFormat:
    if given is not None:
        return given  # type: ignore[return-value]
    found = _SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise ValueError(f"cannot tell the format of {path.name} from its extension; give --input-format")
    return found


@dataclass(frozen=True)
class Row:
    """One request of the input: its line or row number, and the request or why it is not one."""

    index: int
    line: BatchLine | None
    error: MalformedLineError | None = None

    @property
    def custom_id(self) -> str | None:
        return self.line.custom_id if self.line is not None else self.error.custom_id  # type: ignore[union-attr]


# ---- reading -------------------------------------------------------------------------------------------


def jsonl_rows(path: Path) -> Iterator[Row]:
    with path.open("rb") as lines:
        index = 0
        for text in lines:
            if not text.strip():
                continue
            try:
                yield Row(index, parse_line(text))
            except MalformedLineError as exc:
                yield Row(index, None, exc)
            index += 1


def unique_rows(rows: Iterator[Row]) -> Iterator[Row]:
    """The rows, a repeated custom_id made an error without one (custom_ids name answers, so must be
    unique); the same rows on every run over the same input."""
    seen: set[str] = set()
    for row in rows:
        custom_id = row.custom_id
        if custom_id is not None and custom_id in seen:
            yield Row(
                row.index, None, MalformedLineError(f"custom_id {custom_id!r} is repeated", param="custom_id")
            )
            continue
        if custom_id is not None:
            seen.add(custom_id)
        yield row


def count_rows(path: Path, input_format: InputFormat) -> int | None:
    """How many rows the input has, where that is cheap to know (a progress bar's total)."""
    if input_format == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if input_format == "jsonl":
        with path.open("rb") as lines:
            return sum(1 for text in lines if text.strip())
    return None


def table_records(path: Path, input_format: InputFormat) -> Iterator[dict[str, Any]]:
    """A table's rows as column -> value, a batch at a time; CSV cells are read as JSON values where they
    are some (`0.5`, `true`, `["\\n"]`) and as text otherwise, an empty cell as no value."""
    if input_format == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            yield from batch.to_pylist()
        return
    with path.open(newline="", encoding="utf-8") as handle:
        for cells in csv.DictReader(handle):
            yield {name: _cell_value(name, cell) for name, cell in cells.items()}


def _cell_value(column: str, cell: str | None) -> Any:
    if cell is None or cell == "":
        return None
    if column == _PROMPT:
        return cell
    try:
        return json_depth.loads(cell)
    except (json.JSONDecodeError, json_depth.JSONTooDeepError):
        return cell


def table_rows(path: Path, input_format: InputFormat, model: str) -> Iterator[Row]:
    for index, values in enumerate(table_records(path, input_format)):
        try:
            yield Row(index, table_line(index, values, model))
        except MalformedLineError as exc:
            yield Row(index, None, exc)


def table_line(index: int, values: dict[str, Any], model: str) -> BatchLine:
    """A table row as a request: chat when it has messages, a completion when it has a prompt."""
    body = {name: value for name, value in values.items() if value is not None}
    messages, prompt = body.get(_MESSAGES), body.get(_PROMPT)
    if isinstance(messages, str):
        try:
            body[_MESSAGES] = json_depth.loads(messages)
        except (json.JSONDecodeError, json_depth.JSONTooDeepError) as exc:
            raise MalformedLineError(f"messages is not usable JSON: {exc}", param=_MESSAGES) from None
    if messages is not None and prompt is not None:
        raise MalformedLineError("the row has both a prompt and messages; give one", param=_PROMPT)
    if messages is None and prompt is None:
        raise MalformedLineError("the row has neither a prompt nor messages", param=_PROMPT)
    body.setdefault("model", model)
    url = CHAT_COMPLETIONS_URL if messages is not None else COMPLETIONS_URL
    return BatchLine(str(index), url, body)


# ---- writing -------------------------------------------------------------------------------------------


def _append(fd: int, data: bytes) -> None:
    """One row's answer in one write to an O_APPEND file: a kill leaves it whole or absent."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _complete_lines(path: Path) -> Iterator[bytes]:
    """The file's complete lines, after cutting off a last line a crash left unfinished."""
    if not path.exists():
        return
    with path.open("rb+") as handle:
        data = handle.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            handle.truncate(end)
    yield from data[:end].splitlines()


class Output(Protocol):
    failed: int
    skipped: int

    def is_done(self, row: Row) -> bool: ...

    def write(self, row: Row, record: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class JsonlOutput:
    """OpenAI batch output lines, by custom_id. A line without a usable custom_id gets an error record whose
    custom_id is null; those are written as their lines are read, in input order, so on a rerun the first k
    such lines are the k already written."""

    def __init__(self, path: Path) -> None:
        self.done: set[str] = set()
        self.unkeyed_written = 0
        self.failed = 0
        self.skipped = 0
        for text in _complete_lines(path):
            record = json.loads(text)
            if record.get("custom_id") is None:
                self.unkeyed_written += 1
            else:
                self.done.add(record["custom_id"])
            self.failed += record_failed(record)
        self._unkeyed_read = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def is_done(self, row: Row) -> bool:
        if row.custom_id is not None:
            done = row.custom_id in self.done
        else:
            self._unkeyed_read += 1
            done = self._unkeyed_read <= self.unkeyed_written
        self.skipped += done
        return done

    def write(self, row: Row, record: dict[str, Any]) -> None:
        self.failed += record_failed(record)
        _append(self._fd, record_line(record))

    def finish(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class TableOutput:
    """The input table with OUTPUT_COLUMNS added. Answers are journalled (`OUT.partial`, one JSON line per
    row, by row index) until every row has one; then the table is written in input order and the journal
    removed. A finished table read back is the journal of a rerun."""

    def __init__(self, path: Path, input_path: Path, input_format: InputFormat) -> None:
        self.path = path
        self.input_path = input_path
        self.input_format = input_format
        self.journal = path.with_name(path.name + ".partial")
        self.results: dict[int, dict[str, Any]] = {}
        self.skipped = 0
        if self.journal.exists():
            for text in _complete_lines(self.journal):
                entry = json.loads(text)
                self.results[entry.pop("row")] = entry
        elif path.exists():
            for index, values in enumerate(table_records(path, input_format)):
                self.results[index] = {column: values.get(column) for column in OUTPUT_COLUMNS}
        self.failed = sum(1 for columns in self.results.values() if columns["error"] is not None)
        self._fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def is_done(self, row: Row) -> bool:
        done = row.index in self.results
        self.skipped += done
        return done

    def write(self, row: Row, record: dict[str, Any]) -> None:
        columns = output_columns(record)
        self.failed += columns["error"] is not None
        self.results[row.index] = columns
        _append(self._fd, record_line({"row": row.index, **columns}))

    def finish(self) -> None:
        partial = self.path.with_name(self.path.name + ".writing")
        if self.input_format == "parquet":
            self._write_parquet(partial)
        else:
            self._write_csv(partial)
        os.replace(partial, self.path)
        os.close(self._fd)
        self._fd = -1
        self.journal.unlink()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)

    def _write_csv(self, destination: Path) -> None:
        with self.input_path.open(newline="", encoding="utf-8") as source:
            reader = csv.DictReader(source)
            columns = _added_to(list(reader.fieldnames or []))
            with destination.open("w", newline="", encoding="utf-8") as target:
                writer = csv.DictWriter(target, fieldnames=columns)
                writer.writeheader()
                for index, cells in enumerate(reader):
                    writer.writerow({**cells, **self.results[index]})

    def _write_parquet(self, destination: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = pq.ParquetFile(self.input_path)
        _added_to(source.schema_arrow.names)
        types = {"prompt_tokens": pa.int64(), "completion_tokens": pa.int64()}
        schema = source.schema_arrow
        for column in OUTPUT_COLUMNS:
            schema = schema.append(pa.field(column, types.get(column, pa.string())))
        start = 0
        with pq.ParquetWriter(destination, schema) as writer:
            for batch in source.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
                rows = range(start, start + batch.num_rows)
                arrays = list(batch.columns) + [
                    pa.array([self.results[i][column] for i in rows], schema.field(column).type)
                    for column in OUTPUT_COLUMNS
                ]
                writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
                start += batch.num_rows


def _added_to(columns: list[str]) -> list[str]:
    clash = [column for column in OUTPUT_COLUMNS if column in columns]
    if clash:
        raise ValueError(f"the input already has the output column {clash[0]!r}")
    return columns + list(OUTPUT_COLUMNS)


def output_columns(record: dict[str, Any]) -> dict[str, Any]:
    """A batch output record as a table's output columns."""
    columns: dict[str, Any] = dict.fromkeys(OUTPUT_COLUMNS)
    response = record["response"]
    if record["error"] is not None:
        columns["error"] = record["error"]["message"]
        return columns
    body = response["body"]
    if response["status_code"] != 200:
        columns["error"] = body["error"]["message"]
        return columns
    choice = body["choices"][0]
    columns["output_text"] = choice["message"]["content"] if "message" in choice else choice["text"]
    columns["finish_reason"] = choice["finish_reason"]
    columns["prompt_tokens"] = body["usage"]["prompt_tokens"]
    columns["completion_tokens"] = body["usage"]["completion_tokens"]
    return columns


# ---- running -------------------------------------------------------------------------------------------


@dataclass
class Summary:
    answered: int = 0
    skipped: int = 0
    failed: int = 0
    output_tokens: int = 0
    seconds: float = 0.0


async def answer_rows(
    rows: Iterator[Row],
    output: Output,
    answer: Answer,
    *,
    width: int,
    on_row: Callable[[], None],
) -> int:
    """Answer every row the output does not hold yet, `width` at a time; `on_row` is called once per row
    (answered or skipped). Returns how many were answered."""
    in_flight: set[asyncio.Task[None]] = set()
    answered = 0

    async def run(row: Row) -> None:
        nonlocal answered
        assert row.line is not None
        status, body = await answer(row.line.url, row.line.body)
        output.write(row, response_record(row.line.custom_id, status, body))
        answered += 1
        on_row()

    try:
        for row in rows:
            if output.is_done(row):
                on_row()
                continue
            if row.line is None:
                assert row.error is not None
                output.write(row, error_record(row.error.custom_id, "invalid_request", str(row.error)))
                answered += 1
                on_row()
                continue
            while len(in_flight) >= width:
                finished, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    task.result()
            in_flight.add(asyncio.create_task(run(row)))
        for task in asyncio.as_completed(in_flight):
            await task
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
    return answered


def run_batch(
    input_path: Path,
    output_path: Path,
    *,
    input_format: str | None,
    config: EngineConfig,
    served_model_name: str,
    progress: bool,
) -> Summary:
    """Answer the input's rows that the output does not hold yet; raises ValueError for unusable input."""
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    found_format = input_format_of(input_path, input_format)
    if output_path.resolve() == input_path.resolve():
        raise ValueError("the output file must not be the input file")
    if found_format == "jsonl":
        rows = unique_rows(jsonl_rows(input_path))
        output: Output = JsonlOutput(output_path)
    else:
        rows = table_rows(input_path, found_format, served_model_name)
        output = TableOutput(output_path, input_path, found_format)
    try:
        engine = LLMEngine(config)
        total = count_rows(input_path, found_format)
        summary = asyncio.run(
            _answer_all(rows, output, engine, served_model_name, total=total, progress=progress)
        )
        output.finish()
    finally:
        output.close()
    summary.skipped, summary.failed = output.skipped, output.failed
    return summary


async def _answer_all(
    rows: Iterator[Row],
    output: Output,
    engine: LLMEngine,
    served_model_name: str,
    *,
    total: int | None,
    progress: bool,
) -> Summary:
    from kvfleet.runtime.batch.answers import answer_line
    from kvfleet.runtime.engine.in_process import InProcessEngine
    from kvfleet.runtime.generation_config import max_tokens_limit
    from kvfleet.runtime.serving.service import OpenAIService, ServiceSettings
    from tqdm import tqdm

    config = engine.config
    # As vLLM's run-batch serves rows: with the sampling defaults of the engine's generation config.
    defaults = config.sampling_defaults()
    settings = ServiceSettings(
        served_model_name=served_model_name,
        default_sampling_params=defaults,
        max_tokens_limit=max_tokens_limit(config.generation_config, defaults),
        reasoning_parser=config.reasoning_parser_name(),
    )
    started = time.monotonic()
    async with InProcessEngine(engine) as in_process:
        service = OpenAIService(in_process, settings)
        with tqdm(total=total, unit="row", disable=not progress, dynamic_ncols=True) as bar:

            def on_row() -> None:
                elapsed = max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(f"{in_process.output_tokens / elapsed:.1f} tok/s", refresh=False)
                bar.update(1)

            answered = await answer_rows(
                rows,
                output,
                functools.partial(answer_line, service),
                width=2 * engine.config.max_num_seqs,
                on_row=on_row,
            )
        return Summary(
            answered=answered,
            output_tokens=in_process.output_tokens,
            seconds=time.monotonic() - started,
        )
