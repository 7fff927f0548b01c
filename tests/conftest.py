"""Fixtures shared by every test folder: model folders made by `kvfleet make-model`, once per session, and
real `kvfleet serve` processes on loopback, started for the tests and always stopped by their PID.

Under pytest-xdist's `--dist loadfile` (`make test`), a test module is the unit of work: its tests run in one
worker, one after the other, so that what the module shares (its servers, models and engines) is made once.

Tests start the command as `python -P -m kvfleet`: -P keeps the checkout off `sys.path`, where its
operator/ folder would shadow the standard library's `operator` module in an environment without the
editable install."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ports import free_port
from servers import MODEL_NAME, ServerProcess
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling

# Triton decides between compiling and interpreting when a kernel is defined, its own library's kernels
# (tl.sum, ...) included when triton is first imported; and a test module collected before the kernel tests
# may import it (Transformers does). So the interpreter, with which the kernel tests run on the CPU, is chosen
# here, where pytest starts, before any test module is imported. No test runs a compiled kernel: there is no
# GPU, and the tests that build for one start a process without it.
os.environ["TRITON_INTERPRET"] = "1"

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Enough KV blocks for every test's requests, few enough that the pool allocates in a blink.
BASE_ARGS = ("--served-model-name", MODEL_NAME, "--num-gpu-blocks-override", "512", "--dtype", "float32")


class ModuleScheduling(LoadFileScheduling):
    """xdist's `--dist loadfile`, a test module to a worker, except that the end-to-end tests are one unit:
    they share one local cluster, which a second worker would build and start again."""

    def _split_scope(self, nodeid: str) -> str:
        module = super()._split_scope(nodeid)
        return "e2e" if module.startswith("e2e/") else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> ModuleScheduling | None:
    return ModuleScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def make_model(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Returns a function (arch, preset, seed, *make-model options) -> model folder, built by the real
    `make-model` command and cached: for the session, and across xdist workers (in the folder above theirs,
    which the run's controller made for them), each folder built by whichever worker asks first. The command
    runs in this process, which has imported torch already: a process of its own would spend most of its
    time importing it again."""
    from kvfleet.runtime.cli import make_model as make_model_command

    basetemp = tmp_path_factory.getbasetemp()
    root = (basetemp.parent if hasattr(pytestconfig, "workerinput") else basetemp) / "models"
    root.mkdir(exist_ok=True)

    def build(arch: str = "llama", preset: str = "tiny", seed: int = 0, *options: str) -> Path:
        key = "\0".join((arch, preset, str(seed), *options))
        out = root / f"{arch}-{preset}-{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        with _locked(out.with_suffix(".lock")):
            if not out.exists():
                command = ["--arch", arch, "--preset", preset, "--seed", str(seed), *options]
                partial = out.with_suffix(".partial")  # a failed build's leftovers are cleared first
                shutil.rmtree(partial, ignore_errors=True)
                make_model_command.main([*command, str(partial)], standalone_mode=False)
                partial.rename(out)
        return out

    return build


@pytest.fixture(scope="session")
def tiny_llama(make_model: Callable[..., Path]) -> Path:
    return make_model("llama", "tiny")


@contextlib.contextmanager
def running_servers(tiny_llama: Path, logs: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start(*extra_args, api_key=None, command=("serve",), model=None, env=None) -> a ready ServerProcess of
    `model` (the tiny llama by default), with `env` over this process's environment; every one started is
    stopped on exit."""
    started: list[ServerProcess] = []

    def start(
        *extra_args: str,
        api_key: str | None = None,
        wait: bool = True,
        command: tuple[str, ...] = ("serve",),
        model: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        port = free_port()
        args = [
            sys.executable,
            "-P",
            "-m",
            "kvfleet",
            *command,
            "--model",
            str(model or tiny_llama),
            *BASE_ARGS,
        ]
        args += ["--host", "127.0.0.1", "--port", str(port), *extra_args]
        if api_key is not None:
            args += ["--api-key", api_key]
        log_path = logs / f"server-{port}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, api_key)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def start_server(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ServerProcess]]:
    """Starts servers for one test module, all stopped when the module is done: each is some 400 MB, so a
    session's worth of them at once would not fit in memory."""
    with running_servers(tiny_llama, tmp_path_factory.mktemp("server-logs")) as start:
        yield start


# The shared server's key (tests/server).
API_KEY = "test-key"


@pytest.fixture(scope="session")
def api_server_events_port() -> int:
    """Where the shared server publishes its KV-cache events."""
    return free_port()


@pytest.fixture(scope="session")
def api_server(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, api_server_events_port: int
) -> Iterator[ServerProcess]:
    """The server tests' shared server: priority scheduling, an API key, a small body limit to test against,
    KV-cache events, and a store of Responses API answers."""
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{api_server_events_port}"})
    with running_servers(tiny_llama, tmp_path_factory.mktemp("shared-server-logs")) as start:
        yield start(
            "--scheduling-policy",
            "priority",
            "--max-request-body-bytes",
            "65536",
            "--kv-events-config",
            events,
            *("--max-stored-responses", "64"),
            api_key=API_KEY,
        )
