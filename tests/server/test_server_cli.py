"""`kvfleet serve` refuses what it cannot do, a model that fails to load ends the process, and its log shows
the weights loading."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from servers import ServerProcess


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "kvfleet", "serve", *args]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_serve(*args), capture_output=True, text=True, timeout=120, check=False, env=env)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tensor-parallel-size", "3"],
            "tensor_parallel_size 3 does not divide the model's 4 attention heads",
        ),
        (
            ["--tensor-parallel-size", "8"],
            "tensor_parallel_size 8 does not divide the model's 4 attention heads",
        ),
        (["--pipeline-parallel-size", "3"], "pipeline_parallel_size 3 does not divide the model's 2 layers"),
        (
            ["--pipeline-parallel-size", "3", "--nnodes", "2"],
            "pipeline_parallel_size = 3 ranks do not split evenly over nnodes=2",
        ),
        (["--nnodes", "2", "--node-rank", "2"], "node_rank must be in [0, 2) for nnodes=2"),
        (["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"], "the only backend is mp"),
        (["--tensor-parallel-size", "2", "--enable-lora"], "enable_lora needs tensor_parallel_size"),
    ],
)
def test_a_split_the_model_or_the_nodes_cannot_take_is_refused_at_start(
    tiny_llama: Path, flags: list[str], message: str
) -> None:
    completed = _run("--model", str(tiny_llama), "--port", "0", *flags)
    assert completed.returncode == 2, completed.stderr
    assert message in " ".join(completed.stderr.split())


def test_bad_engine_option_is_a_usage_error(tiny_llama: Path) -> None:
    completed = _run("--model", str(tiny_llama), "--block-size", "12")
    assert completed.returncode == 2
    assert "block_size must be a power of two" in completed.stderr


def test_a_default_tier_above_what_clients_may_claim_is_refused(tiny_llama: Path) -> None:
    completed = _run(
        "--model", str(tiny_llama), "--default-priority", "critical", "--max-priority-tier", "high"
    )
    assert completed.returncode == 2
    assert "--default-priority" in completed.stderr and "more urgent than" in completed.stderr


@pytest.mark.parametrize("source", ["flag", "environment"])
def test_an_empty_api_key_is_refused(tiny_llama: Path, source: str) -> None:
    # An empty key used to turn auth off without a word.
    env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
    args = ["--model", str(tiny_llama), "--port", "0"]
    if source == "flag":
        args += ["--api-key", " "]
    else:
        env["KVFLEET_API_KEY"] = ""
    completed = _run(*args, env=env)
    assert completed.returncode == 2, completed.stderr
    assert "the API key is empty" in completed.stderr and "--api-key" in completed.stderr


def test_a_model_that_cannot_load_ends_the_process(tiny_llama: Path, tmp_path: Path) -> None:
    # A folder that passes the command's own check (its config.json names a known architecture) but holds
    # no weights: the engine finds that out only when it loads them.
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_llama, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        _serve("--model", str(weightless), "--host", "127.0.0.1", "--port", str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, output
    assert "the model could not be loaded" in output
    # Nothing is left listening.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_the_log_counts_the_checkpoint_shards_as_they_load(
    api_server: ServerProcess, tiny_llama: Path
) -> None:
    shards = len(list(tiny_llama.glob("*.safetensors")))
    lines = [
        line
        for line in api_server.log_path.read_text().splitlines()
        if "Loading safetensors checkpoint" in line
    ]
    assert lines, api_server.log_tail()
    assert lines[0].startswith(f"Loading safetensors checkpoint shards: 0/{shards} ")
    assert lines[-1].startswith(f"Loading safetensors checkpoint shards: {shards}/{shards} (100%)")


# A template that renders a string and OpenAI's parts differently: `auto` would give it parts.
PARTS_OR_STRING_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
    "{% else %}P:{% for part in m['content'] %}{{ part['text'] }}|{% endfor %}{% endif %}{% endfor %}"
)
TWO_TEXT_PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}
]


def test_chat_template_content_format_string_joins_text_parts_with_newlines(
    api_server: ServerProcess, start_server: Callable[..., ServerProcess], tiny_llama: Path, tmp_path: Path
) -> None:
    """vLLM's rendering of two text parts for a template that takes a string, Transformers' the oracle: the
    model's own template (auto), and a template that loops over parts, told to take a string."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    joined = [{"role": "user", "content": "Hello\nworld"}]
    template = tmp_path / "template.jinja"
    template.write_text(PARTS_OR_STRING_TEMPLATE)
    told = start_server("--chat-template", str(template), "--chat-template-content-format", "string")
    for server, chat_template in ((api_server, None), (told, PARTS_OR_STRING_TEMPLATE)):
        body = {"messages": TWO_TEXT_PARTS, "add_generation_prompt": True}
        answer = httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers(), timeout=30)
        expected = tokenizer.apply_chat_template(
            joined, chat_template=chat_template, add_generation_prompt=True, tokenize=True
        )["input_ids"]
        assert answer.json()["tokens"] == expected


def test_chat_template_flag_replaces_the_model_folders(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}")
    server = start_server("--chat-template", str(template))
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()
    rendered = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "<<user>>hi", "add_special_tokens": False}, timeout=30
    ).json()
    assert chat["tokens"] == rendered["tokens"]
