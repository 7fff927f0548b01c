"""`kvfleet serve` as processes: the API server and its EngineCore, several API servers over one core, what a
dead core does to requests and to the server, what a killed API server leaves behind, requests sent while the
model loads, and huge prompts."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import pytest
from processes import child_processes

if TYPE_CHECKING:
    from servers import ServerProcess

CORE_MODULE = "kvfleet.runtime.engine.core_proc"
API_SERVER_MODULE = "kvfleet.runtime.server.launcher"


def _one_child_running(pid: int, module: str) -> int:
    found = [child for child, command in child_processes(pid).items() if module in command]
    assert len(found) == 1, child_processes(pid)
    return found[0]


def _completion(server: ServerProcess, **body: object) -> httpx.Response:
    request = {"model": server.model_name, "prompt": "hello", "max_tokens": 4, **body}
    return httpx.post(f"{server.url}/v1/completions", json=request, headers=server.headers(), timeout=120)


def _wait_exit(server: ServerProcess, timeout: float) -> int:
    return server.process.wait(timeout)


def _exited(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent (or init) to reap it."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def _loads_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_serve_runs_an_api_server_and_an_engine_core(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server()
    children = child_processes(server.pid)
    assert len(children) == 1 and CORE_MODULE in next(iter(children.values())), children
    assert _completion(server).status_code == 200
    chat = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat_response = httpx.post(
        f"{server.url}/v1/chat/completions", json=chat, headers=server.headers(), timeout=60
    )
    assert chat_response.status_code == 200
    # Only the core runs the model: the API server, having tokenized and rendered the chat template, has not
    # paid for torch's import, most of a start's time.
    assert _loads_torch(next(iter(children))) and not _loads_torch(server.pid)


def test_a_killed_core_fails_requests_with_500_and_ends_the_server(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server()
    core = _one_child_running(server.pid, CORE_MODULE)
    results: dict[str, object] = {}

    def long_request() -> None:
        results["plain"] = _completion(server, max_tokens=2000, ignore_eos=True)

    def long_stream() -> None:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            results["stream_status"] = response.status_code
            results["events"] = [line for line in response.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=long_request), threading.Thread(target=long_stream)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while server.metrics().get("kvfleet:num_requests_running", 0) < 2:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(core, signal.SIGKILL)
    for thread in threads:
        thread.join(30)

    plain = results["plain"]
    assert isinstance(plain, httpx.Response) and plain.status_code == 500
    error = plain.json()["error"]
    assert error["code"] == "engine_dead" and "killed by SIGKILL" in error["message"]
    # The stream had already answered 200: it ends with the error event.
    assert results["stream_status"] == 200
    events = results["events"]
    assert isinstance(events, list)
    last_error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert last_error["code"] == "engine_dead" and events[-1] == "data: [DONE]"
    # The server goes down, non-zero, so that Kubernetes restarts the pod.
    assert _wait_exit(server, 10) != 0
    assert time.monotonic() - killed_at < 10
    assert "killed by SIGKILL" in server.log_tail(80)


def test_health_fails_once_the_core_is_gone(start_server: Callable[..., ServerProcess]) -> None:
    # The process exits once the requests in flight have their errors, or after a grace. One whose body is
    # still coming holds it for the grace, so that the probes land before the exit on a busy machine too.
    server = start_server()
    core = _one_child_running(server.pid, CORE_MODULE)
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as held:
        headers = "".join(f"{name}: {value}\r\n" for name, value in server.headers().items())
        held.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: 100\r\n\r\n{{".encode()
        )
        os.kill(core, signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=server.url, timeout=2) as client:
            while 503 not in statuses and time.monotonic() < deadline:
                statuses.append(client.get("/health").status_code)
    assert statuses[-1] == 503, statuses
    assert _wait_exit(server, 10) != 0


def test_requests_sent_while_the_model_loads_wait_for_it(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(wait=False)
    deadline = time.monotonic() + 120
    while not (cores := [pid for pid, line in child_processes(server.pid).items() if CORE_MODULE in line]):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.01)
    # The core is stopped while it loads (it has barely begun importing torch): the load stays open for as
    # long as the test needs, whatever the machine's speed.
    os.kill(cores[0], signal.SIGSTOP)
    answers: dict[str, httpx.Response] = {}
    try:
        # As vLLM's users do: wait for /health, then send at once.
        while True:
            assert time.monotonic() < deadline, server.log_tail()
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.02)
        loading = httpx.get(f"{server.url}/ready", timeout=5)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        senders = [
            threading.Thread(target=lambda: answers.update(completion=_completion(server))),
            threading.Thread(
                target=lambda: answers.update(
                    chat=httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
                )
            ),
        ]
        for sender in senders:
            sender.start()
        time.sleep(1)
        assert answers == {}, "requests were answered before the model loaded"
    finally:
        os.kill(cores[0], signal.SIGCONT)
    for sender in senders:
        sender.join(120)
    assert loading.status_code == 503, loading.text
    chat_answer, completion = answers["chat"], answers["completion"]
    assert chat_answer.status_code == 200, chat_answer.text
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 4
    server.wait_ready()


def _first_answer(server: ServerProcess) -> httpx.Response:
    """The server's answer to a completion sent as soon as its port opens."""
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, server.log_tail()
        try:
            return _completion(server)
        except httpx.TransportError:
            time.sleep(0.02)


# The port opens some 0.2 to 1.3 s before the tiny model is loaded on a quiet machine; on a busy one the
# model is now and then loaded first, and the server is started again to see a request arrive while it loads.
STARTS_TO_CATCH_LOADING = 3


def test_a_request_waits_for_loading_no_longer_than_the_startup_timeout(
    start_server: Callable[..., ServerProcess],
) -> None:
    for _ in range(STARTS_TO_CATCH_LOADING):
        server = start_server("--startup-request-timeout", "0", wait=False)
        response = _first_answer(server)
        if response.status_code != 200:
            break
        server.stop()
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
    server.wait_ready()
    assert _completion(server).status_code == 200


def test_health_answers_while_10mb_prompts_arrive(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--max-request-body-bytes", str(32 << 20))
    prompt = ("The quick brown fox jumps over the lazy dog. " * 250_000)[: 10 << 20]
    bodies = {
        "/v1/completions": {"model": "tiny", "prompt": prompt},
        "/tokenize": {"model": "tiny", "prompt": prompt},
        "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": prompt}]},
    }
    # Encoded here, not in the senders: encoding 10 MB holds this process's interpreter lock, which would
    # delay the probes before they leave.
    encoded = {route: json.dumps(body).encode() for route, body in bodies.items()}
    answers: dict[str, httpx.Response] = {}

    def send(route: str) -> None:
        headers = {"content-type": "application/json"}
        answers[route] = httpx.post(
            f"{server.url}{route}", content=encoded[route], headers=headers, timeout=120
        )

    senders = [threading.Thread(target=send, args=(route,)) for route in encoded]
    for sender in senders:
        sender.start()
    slowest = 0.0
    while any(sender.is_alive() for sender in senders):
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    # A probe's 1 s timeout, on a machine with a core to spare; where more processes than cores want to run,
    # the server gets its share later, by up to that ratio (at most 3). Reading, checking and refusing the
    # prompts takes the event loop tens of milliseconds; tokenizing one on it would take seconds.
    crowding = min(3.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    assert slowest < crowding, (slowest, crowding)
    for route, response in answers.items():
        assert response.status_code == 400, (route, response.text)
        assert response.json()["error"]["code"] == "context_length_exceeded"
    # And the server is as good as before.
    assert _completion(server).status_code == 200


def test_several_api_servers_share_one_core(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--api-server-count", "2")
    children = child_processes(server.pid)
    assert sorted(API_SERVER_MODULE in c or CORE_MODULE in c for c in children.values()) == [True] * 3, (
        children
    )
    assert sum(CORE_MODULE in command for command in children.values()) == 1
    api_servers = [pid for pid, command in children.items() if API_SERVER_MODULE in command]

    # Fresh connections land on either process; every request is served, and /metrics adds them all up.
    responses = []
    threads = [threading.Thread(target=lambda: responses.append(_completion(server))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [response.status_code for response in responses] == [200] * 8
    finished = [
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
        if line.startswith("kvfleet:requests_finished_total{")
    ]
    assert sum(finished) == 8
    assert not any(_loads_torch(pid) for pid in api_servers)

    os.kill(server.pid, signal.SIGTERM)
    assert _wait_exit(server, 60) == 0
    assert all(_exited(pid) for pid in (*api_servers, *children))


def test_a_stop_while_api_servers_start_is_clean(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--api-server-count", "2", wait=False)
    deadline = time.monotonic() + 120
    # Both started, and still importing their HTTP stack (over a second): neither can drain yet.
    while sum(API_SERVER_MODULE in command for command in child_processes(server.pid).values()) < 2:
        assert time.monotonic() < deadline and server.process.poll() is None, server.log_tail()
        time.sleep(0.005)
    children = child_processes(server.pid)
    os.kill(server.pid, signal.SIGTERM)
    assert _wait_exit(server, 60) == 0, server.log_tail()
    assert all(_exited(pid) for pid in children)


def _unix_socket_paths(pid: int) -> list[Path]:
    """The paths of the Unix sockets that process `pid` has open with a name, found by their inodes."""
    inodes = {
        os.readlink(fd).removeprefix("socket:[").removesuffix("]")
        for fd in Path(f"/proc/{pid}/fd").iterdir()
        if os.readlink(fd).startswith("socket:[")
    }
    entries = (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
    return [Path(entry[7]) for entry in entries if len(entry) == 8 and entry[6] in inodes]


def test_a_killed_api_server_ends_its_core_which_removes_its_socket(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server()
    core = _one_child_running(server.pid, CORE_MODULE)
    # The listening socket and the connections it accepted share the path.
    [socket] = {path for path in _unix_socket_paths(core) if path.name == "engine-core.sock"}
    assert socket.exists()
    os.kill(server.pid, signal.SIGKILL)
    server.process.wait(10)
    deadline = time.monotonic() + 30
    while not _exited(core):
        assert time.monotonic() < deadline, "the core outlived its API server"
        time.sleep(0.1)
    assert not socket.parent.exists()


@pytest.mark.parametrize("victim", ["core", "api server"])
def test_with_several_api_servers_a_death_ends_them_all(
    start_server: Callable[..., ServerProcess], victim: str
) -> None:
    server = start_server("--api-server-count", "2")
    module = CORE_MODULE if victim == "core" else API_SERVER_MODULE
    target = next(pid for pid, command in child_processes(server.pid).items() if module in command)
    os.kill(target, signal.SIGKILL)
    assert _wait_exit(server, 30) != 0
    assert not child_processes(server.pid)
