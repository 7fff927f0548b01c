"""`kvfleet serve` with worker processes: a killed worker ends every request with an error and the whole
server, and two `kvfleet serve` processes on one machine form a two-node group (node 1 serves only
GET /health); losing either node ends the other."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
from kvfleet.runtime import LLM, SamplingParams
from ports import free_port
from processes import child_processes, descendants

if TYPE_CHECKING:
    from servers import ServerProcess

CORE_MODULE = "kvfleet.runtime.engine.core_proc"
WORKER_MODULE = "kvfleet.runtime.executor.worker_proc"
PROMPT = "The quick brown fox"


def _running(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _running(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_killing_a_worker_fails_every_request_and_ends_the_server(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server("--tensor-parallel-size", "2")
    processes = descendants(server.pid)
    (core,) = [pid for pid, command in processes.items() if CORE_MODULE in command]
    workers = [pid for pid, command in child_processes(core).items() if WORKER_MODULE in command]
    assert len(workers) == 2, processes
    client = _client(server)
    outcomes: dict[int, str] = {}
    started = threading.Barrier(5)

    def stream(index: int) -> None:
        try:
            chunks = client.completions.create(
                model=server.model_name,
                prompt=PROMPT,
                max_tokens=1900,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            first = True
            for chunk in chunks:
                if first:
                    started.wait(60)
                    first = False
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    outcomes[index] = f"finished: {chunk.choices[0].finish_reason}"
                    return
            outcomes[index] = "ended without a finish reason"
        except openai.APIError as error:
            outcomes[index] = f"error: {error}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(60)  # every stream has its first tokens
    os.kill(workers[1], signal.SIGKILL)
    assert server.process.wait(30) != 0
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == [0, 1, 2, 3]
    assert all(outcome.startswith("error:") for outcome in outcomes.values()), outcomes
    assert "worker process" in server.log_tail(200) and "killed by SIGKILL" in server.log_tail(200)
    assert _wait_gone(list(processes), 10) == []


def _serve(model: Path, port: int, node_rank: int, master_port: int) -> list[str]:
    return [
        sys.executable,
        "-P",
        "-m",
        "kvfleet",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
    ]


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are both free now."""
    while True:
        port = free_port()
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def _start_node1(model: Path, log_path: Path, master_port: int) -> tuple[subprocess.Popen[bytes], str]:
    """Node 1's `kvfleet serve` and the URL of its /health."""
    port = free_port()
    with log_path.open("wb") as log:
        node1 = subprocess.Popen(_serve(model, port, 1, master_port), stdout=log, stderr=subprocess.STDOUT)
    return node1, f"http://127.0.0.1:{port}"


def _start_node0(start_server: Callable[..., ServerProcess], master_port: int) -> ServerProcess:
    return start_server(
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
    )


def test_two_nodes_form_one_group_and_a_broken_group_ends_node_one(
    tiny_llama: Path, tmp_path: Path, start_server: Callable[..., ServerProcess]
) -> None:
    master_port = _free_port_pair()
    node1, node1_url = _start_node1(tiny_llama, tmp_path / "node1.log", master_port)
    try:
        # Node 1 alone cannot form the group: it answers 503 until node 0 is up.
        deadline = time.monotonic() + 60
        while True:
            assert node1.poll() is None, (tmp_path / "node1.log").read_text()
            try:
                status = httpx.get(f"{node1_url}/health", timeout=2).status_code
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert status == 503
        assert httpx.get(f"{node1_url}/v1/models", timeout=2).status_code == 404

        node0 = _start_node0(start_server, master_port)
        assert len([c for c in descendants(node0.pid).values() if WORKER_MODULE in c]) == 1
        assert len([c for c in child_processes(node1.pid).values() if WORKER_MODULE in c]) == 1
        assert httpx.get(f"{node1_url}/health", timeout=2).status_code == 200

        completion = _client(node0).completions.create(
            model=node0.model_name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=512)
        expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert completion.choices[0].text == expected[0].outputs[0].text

        # Node 0 goes away: node 1's worker loses the group, and node 1 exits non-zero.
        node0_processes = list(descendants(node0.pid))
        node1_processes = list(descendants(node1.pid))
        os.kill(node0.pid, signal.SIGKILL)
        assert node1.wait(30) != 0
        assert _wait_gone(node0_processes + node1_processes, 30) == []
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_node_one_stopped_ends_an_idle_node_zero(
    tiny_llama: Path, tmp_path: Path, start_server: Callable[..., ServerProcess]
) -> None:
    """No collective runs while idle, yet node 0 sees the other node's workers go and exits, so that the
    group starts again whole (a Kubernetes pod of the group deleted, its container restarted)."""
    master_port = _free_port_pair()
    node1, node1_url = _start_node1(tiny_llama, tmp_path / "node1.log", master_port)
    try:
        node0 = _start_node0(start_server, master_port)
        assert httpx.get(f"{node1_url}/health", timeout=2).status_code == 200
        node0_processes = list(descendants(node0.pid))
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(30) == 0
        assert node0.process.wait(30) != 0
        assert "connection to tcp://" in node0.log_tail(200), node0.log_tail(200)
        assert _wait_gone(node0_processes, 30) == []
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
