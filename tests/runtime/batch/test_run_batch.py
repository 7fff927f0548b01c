"""`kvfleet run-batch` as a user runs it: a real process on JSONL, CSV and Parquet files of mixed chat and
completion rows, each answer checked against the offline `LLM` on the same row; killed mid-run and rerun."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvfleet.runtime import LLM, SamplingParams

MODEL_NAME = "tiny"
ENGINE_ARGS = ("--served-model-name", MODEL_NAME, "--num-gpu-blocks-override", "256", "--dtype", "float32")
MAX_TOKENS = 6
RUN_TIMEOUT_S = 300

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "Hello"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cat?"}],
    [{"role": "user", "content": "Count to five"}],
]


def run_batch(model: Path, *args: str, wait: bool = True) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-P", "-m", "kvfleet", "run-batch", "--model", str(model), *ENGINE_ARGS]
    return subprocess.run(
        [*command, "--no-progress", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=256)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def expected_completion(llm: LLM, prompt: str) -> str:
    return llm.generate([prompt], greedy())[0].outputs[0].text


def expected_chat(llm: LLM, messages: list[dict[str, Any]]) -> str:
    return llm.chat([messages], greedy())[0].outputs[0].text


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def mixed_lines() -> list[dict[str, Any]]:
    sampling = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    lines = []
    for index, prompt in enumerate(PROMPTS):
        lines.append(batch_line(f"completion-{index}", "/v1/completions", {"prompt": prompt, **sampling}))
        if index < len(CONVERSATIONS):
            body = {"messages": CONVERSATIONS[index], **sampling}
            lines.append(batch_line(f"chat-{index}", "/v1/chat/completions", body))
    return lines


def write_jsonl(path: Path, lines: list[Any]) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_answers_match_the_offline_engine_and_bad_lines_get_error_records(
    tiny_llama: Path, llm: LLM, tmp_path: Path
) -> None:
    good = mixed_lines()
    sampling = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS}
    bad = [
        "{not json",
        batch_line("wrong-model", "/v1/completions", {"prompt": "x", "model": "other", "max_tokens": 2}),
        batch_line("bad-url", "/v1/embeddings", {"input": "x", "model": MODEL_NAME}),
        batch_line("bad-temperature", "/v1/completions", {"prompt": "x", **sampling, "temperature": "hot"}),
        batch_line("no-messages", "/v1/chat/completions", {"messages": [], **sampling}),
        batch_line("completion-0", "/v1/completions", {"prompt": "repeated id", **sampling}),
        # It used to end the whole run with RecursionError.
        json.dumps(
            batch_line("deep", "/v1/completions", {"prompt": "x", **sampling, "user": "<deep>"})
        ).replace('"<deep>"', "[" * 5000 + "]" * 5000),
    ]
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, good[:3] + bad + good[3:])

    result = run_batch(tiny_llama, "-i", str(source), "-o", str(answers))

    assert result.returncode == 1, result.stderr
    records = read_jsonl(answers)
    assert len(records) == len(good) + len(bad)
    by_id = {record["custom_id"]: record for record in records if record["custom_id"] is not None}
    for line in good:
        record = by_id[line["custom_id"]]
        assert record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200
        body = response["body"]
        if line["url"] == "/v1/completions":
            assert body["object"] == "text_completion"
            assert body["choices"][0]["text"] == expected_completion(llm, line["body"]["prompt"])
        else:
            assert body["object"] == "chat.completion"
            message = body["choices"][0]["message"]
            assert message["content"] == expected_chat(llm, line["body"]["messages"])
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert response["request_id"] == body["id"]

    unkeyed = [record for record in records if record["custom_id"] is None]
    assert [record["error"]["code"] for record in unkeyed] == ["invalid_request"] * 3
    assert "not valid JSON" in unkeyed[0]["error"]["message"]
    assert "repeated" in unkeyed[1]["error"]["message"]
    assert "nests deeper than 64 levels" in unkeyed[2]["error"]["message"]
    assert by_id["bad-url"]["response"] is None
    assert by_id["bad-url"]["error"]["code"] == "invalid_request"
    wrong_model = by_id["wrong-model"]["response"]
    assert wrong_model["status_code"] == 404
    assert wrong_model["body"]["error"]["code"] == "model_not_found"
    for custom_id, param in (("bad-temperature", "temperature"), ("no-messages", "messages")):
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 400
        error = response["body"]["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
    assert "failed in all" in result.stderr


def table_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for index, prompt in enumerate(PROMPTS):
        rows.append({"prompt": prompt, "messages": None, "max_tokens": MAX_TOKENS, "tag": f"p{index}"})
        if index < len(CONVERSATIONS):
            rows.append(
                {"prompt": None, "messages": CONVERSATIONS[index], "max_tokens": 3, "tag": f"c{index}"}
            )
    rows.append({"prompt": None, "messages": None, "max_tokens": 3, "tag": "empty"})
    return rows


def check_table(llm: LLM, rows: list[dict[str, Any]], answered: list[dict[str, Any]]) -> None:
    """Row by row, in input order: the input columns kept, the answer the offline engine gives."""
    assert [row["tag"] for row in answered] == [row["tag"] for row in rows]
    for row, out in zip(rows, answered, strict=True):
        if row["prompt"] is None and row["messages"] is None:
            assert out["output_text"] is None
            assert "neither a prompt nor messages" in out["error"]
            continue
        assert out["error"] is None
        params = SamplingParams(temperature=0.0, max_tokens=row["max_tokens"], ignore_eos=True)
        if row["prompt"] is not None:
            expected = llm.generate([row["prompt"]], params)[0]
        else:
            expected = llm.chat([row["messages"]], params)[0]
        assert out["output_text"] == expected.outputs[0].text
        assert out["finish_reason"] == "length"
        assert int(out["completion_tokens"]) == row["max_tokens"]
        assert int(out["prompt_tokens"]) == len(expected.prompt_token_ids)


def test_csv_table_gets_output_columns_in_input_order(tiny_llama: Path, llm: LLM, tmp_path: Path) -> None:
    rows = table_rows()
    source, answers = tmp_path / "in.csv", tmp_path / "out.csv"
    columns = ["prompt", "messages", "max_tokens", "temperature", "ignore_eos", "tag"]
    with source.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            messages = json.dumps(row["messages"]) if row["messages"] is not None else ""
            cells = {"prompt": row["prompt"] or "", "messages": messages, "max_tokens": row["max_tokens"]}
            writer.writerow({**cells, "temperature": "0", "ignore_eos": "true", "tag": row["tag"]})

    result = run_batch(tiny_llama, "-i", str(source), "-o", str(answers))

    assert result.returncode == 1, result.stderr  # the row with neither prompt nor messages
    with answers.open(newline="") as handle:
        answered = [
            {name: (value if value != "" else None) for name, value in row.items()}
            for row in csv.DictReader(handle)
        ]
    check_table(llm, rows, answered)
    assert not (tmp_path / "out.csv.partial").exists()


def test_parquet_table_gets_output_columns_in_input_order(tiny_llama: Path, llm: LLM, tmp_path: Path) -> None:
    rows = table_rows()
    source, answers = tmp_path / "in.parquet", tmp_path / "out.parquet"
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {
            "prompt": pa.array([row["prompt"] for row in rows], pa.string()),
            "messages": pa.array([row["messages"] for row in rows], pa.list_(message)),
            "max_tokens": pa.array([row["max_tokens"] for row in rows], pa.int64()),
            "temperature": pa.array([0.0] * len(rows), pa.float64()),
            "ignore_eos": pa.array([True] * len(rows), pa.bool_()),
            "tag": pa.array([row["tag"] for row in rows], pa.string()),
        }
    )
    pq.write_table(table, source)

    result = run_batch(tiny_llama, "-i", str(source), "-o", str(answers))

    assert result.returncode == 1, result.stderr
    answered = pq.read_table(answers)
    assert answered.schema.field("completion_tokens").type == pa.int64()
    assert answered.column("messages").to_pylist() == table.column("messages").to_pylist()
    check_table(llm, rows, answered.to_pylist())


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_killed_run_resumes_without_duplicates_or_gaps(tiny_llama: Path, tmp_path: Path, suffix: str) -> None:
    count = 240
    source, answers = tmp_path / f"in.{suffix}", tmp_path / f"out.{suffix}"
    prompts = [f"Story number {index} begins" for index in range(count)]
    if suffix == "jsonl":
        body = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        write_jsonl(
            source,
            [batch_line(f"row-{i}", "/v1/completions", {"prompt": p, **body}) for i, p in enumerate(prompts)],
        )
        progress = answers
    else:
        source.write_text("prompt,max_tokens,ignore_eos\n" + "".join(f"{p},24,true\n" for p in prompts))
        progress = tmp_path / "out.csv.partial"
    # A narrow batch, so that answers arrive in many waves and the kill lands between them.
    command = [sys.executable, "-P", "-m", "kvfleet", "run-batch", "--model", str(tiny_llama), *ENGINE_ARGS]
    command += ["--max-num-seqs", "4", "--no-progress", "-i", str(source), "-o", str(answers)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (progress.exists() and progress.read_bytes().count(b"\n") >= 20):
            assert process.poll() is None, "run-batch ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    written_before = progress.read_bytes().count(b"\n")
    assert written_before < count

    result = run_batch(tiny_llama, "-i", str(source), "-o", str(answers))

    assert result.returncode == 0, result.stderr
    assert f"{written_before} already in" in result.stderr
    if suffix == "jsonl":
        ids = [record["custom_id"] for record in read_jsonl(answers)]
        assert sorted(ids) == sorted(f"row-{i}" for i in range(count))
    else:
        with answers.open(newline="") as handle:
            answered = list(csv.DictReader(handle))
        assert [row["prompt"] for row in answered] == prompts
        assert all(row["output_text"] and row["completion_tokens"] == "24" for row in answered)
        assert not progress.exists()


@pytest.mark.parametrize("generation_config", ["auto", "FOLDER"])
def test_rows_take_the_generation_configs_sampling_defaults(
    tiny_llama: Path, llm: LLM, tmp_path: Path, generation_config: str
) -> None:
    """As vLLM's run-batch: a chat row that leaves max_tokens and temperature unset takes generation_config's;
    the model folder's (auto) leaves a row free to ask for more tokens, another folder's bounds every row."""
    recommended = {"max_new_tokens": 2, "temperature": 0.0}
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(recommended))
    model = tiny_llama
    if generation_config == "auto":
        model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
        config = json.loads((model / "generation_config.json").read_text())
        (model / "generation_config.json").write_text(json.dumps({**config, **recommended}))
    unset = {"model": MODEL_NAME, "messages": CONVERSATIONS[0], "ignore_eos": True}
    lines = [
        batch_line("unset", "/v1/chat/completions", unset),
        batch_line("asks-for-more", "/v1/chat/completions", {**unset, "max_tokens": 5}),
    ]
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, lines)
    flag = str(folder) if generation_config == "FOLDER" else "auto"
    result = run_batch(model, "-i", str(source), "-o", str(answers), "--generation-config", flag)
    assert result.returncode == 0, result.stderr
    by_id = {record["custom_id"]: record["response"]["body"] for record in read_jsonl(answers)}
    expected = llm.chat([CONVERSATIONS[0]], greedy(2))[0].outputs[0].text
    assert by_id["unset"]["choices"][0]["message"]["content"] == expected
    assert by_id["unset"]["usage"]["completion_tokens"] == 2
    assert by_id["asks-for-more"]["usage"]["completion_tokens"] == (5 if generation_config == "auto" else 2)
