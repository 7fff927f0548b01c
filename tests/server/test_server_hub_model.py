"""`kvfleet serve ORG/NAME --revision REV`, as `vllm serve` takes a Hub model: fetched with huggingface_hub
into the Hugging Face cache before the port opens (its weight, config and tokenizer files only), read from
the cache alone under HF_HUB_OFFLINE=1, and a repository or revision the Hub lacks refused in one line
within 5 s.

No hub is reachable from the tests: a local aiohttp server answers the part of the Hub's HTTP API that
huggingface_hub's snapshot_download calls (a revision's commit, the commit's file tree, each file's metadata
and bytes), serving the tiny model folder; HF_ENDPOINT points the processes at it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from ports import free_port
from servers import ServerProcess

REPO_ID = "org/tiny"
REVISION = "v1"
# The same files in a private repository, which answers only requests that send its token.
PRIVATE_ID = "org/private"
TOKEN = "hf_test_token"
# A file snapshot_download must leave behind: it matches none of the weight, config and tokenizer patterns.
EXTRA_FILE = "README.md"


@dataclass
class FakeHub:
    """One repository whose only revision is REVISION, holding `files`; `requests` counts what was asked."""

    files: dict[str, bytes]
    url: str = ""
    requests: list[str] = field(default_factory=list)

    @property
    def commit(self) -> str:
        digest = hashlib.sha1(REVISION.encode())
        for name in sorted(self.files):
            digest.update(name.encode() + hashlib.sha256(self.files[name]).digest())
        return digest.hexdigest()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/api/models/{org}/{name}/revision/{revision}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_get("/{org}/{name}/resolve/{revision}/{path:.+}", self._file)  # HEAD too
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        return await handler(request)

    def _check(self, request: web.Request) -> None:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        private = repo_id == PRIVATE_ID and request.headers.get("Authorization") == f"Bearer {TOKEN}"
        if repo_id != REPO_ID and not private:
            raise web.HTTPUnauthorized(headers={"X-Error-Code": "RepoNotFound"})
        if request.match_info["revision"] not in (REVISION, self.commit):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"})

    async def _info(self, request: web.Request) -> web.Response:
        self._check(request)
        siblings = [{"rfilename": name} for name in self.files]
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response({"id": repo_id, "sha": self.commit, "siblings": siblings})

    async def _tree(self, request: web.Request) -> web.Response:
        self._check(request)
        entries = [
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for name, data in self.files.items()
        ]
        return web.json_response(entries)

    async def _file(self, request: web.Request) -> web.Response:
        self._check(request)
        data = self.files.get(request.match_info["path"])
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.commit})
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        return web.Response(body=data, headers=headers)


@pytest.fixture(scope="module")
def hub(tiny_llama: Path) -> Iterator[FakeHub]:
    files = {path.name: path.read_bytes() for path in tiny_llama.iterdir() if path.is_file()}
    fake = FakeHub({**files, EXTRA_FILE: b"# tiny\n"})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(fake.app())
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result()
    port = free_port()
    asyncio.run_coroutine_threadsafe(web.TCPSite(runner, "127.0.0.1", port).start(), loop).result()
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf-home")


def hub_env(hub: FakeHub, hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home), **extra}


@pytest.fixture(scope="module")
def hub_server(
    hub: FakeHub, hf_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    port = free_port()
    command = [sys.executable, "-P", "-m", "kvfleet", "serve", REPO_ID, "--revision", REVISION]
    command += [
        "--num-gpu-blocks-override",
        "512",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log_path = tmp_path_factory.mktemp("hub-server") / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=hub_env(hub, hf_home))
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, api_key=None, model_name=REPO_ID)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _completion(server: ServerProcess, model: str) -> dict[str, object]:
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=60)
    assert reply.status_code == 200, reply.text
    return {"text": reply.json()["choices"][0]["text"], "usage": reply.json()["usage"]}


def test_a_hub_model_serves_what_its_folder_serves(
    hub_server: ServerProcess, api_server: ServerProcess, hub: FakeHub, hf_home: Path
) -> None:
    # Named as given, as vLLM names it.
    models = httpx.get(f"{hub_server.url}/v1/models", timeout=10).json()["data"]
    assert [model["id"] for model in models] == [REPO_ID]
    assert _completion(hub_server, REPO_ID) == _completion(api_server, api_server.model_name)
    # In the standard cache layout, with only the weight, config and tokenizer files.
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / hub.commit
    fetched = {path.name: path.read_bytes() for path in snapshot.iterdir()}
    assert fetched == {name: data for name, data in hub.files.items() if name != EXTRA_FILE}
    # huggingface_hub's progress bar, before the port opens.
    log = hub_server.log_path.read_text(errors="replace")
    assert -1 < log.find(f"Fetching {len(fetched)} files") < log.find("Uvicorn running")


def _resolved(env: dict[str, str], **options: str) -> list[str]:
    """The model and tokenizer folders an EngineConfig of `options` (at REVISION) resolves to in a process of
    its own with `env`, and the config's repr."""
    resolve = (
        "from kvfleet.runtime.config import EngineConfig; "
        f"config = EngineConfig(revision={REVISION!r}, **{options!r}); "
        "print(config.model); print(config.tokenizer); print(repr(config))"
    )
    completed = subprocess.run(
        [sys.executable, "-P", "-c", resolve], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    return completed.stdout.splitlines()


def test_the_cache_serves_it_offline(hub_server: ServerProcess, hub: FakeHub, hf_home: Path) -> None:
    """The second resolution, as `LLM(model, revision=...)` and the serve command make it: the engine's config
    names the cached folders (the tokenizer's too), and the hub is not asked."""
    asked = len(hub.requests)
    lines = _resolved(hub_env(hub, hf_home, HF_HUB_OFFLINE="1"), model=REPO_ID, tokenizer=REPO_ID)
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / hub.commit
    assert [Path(line) for line in lines[:2]] == [snapshot, snapshot]
    assert len(hub.requests) == asked


def test_download_dir_takes_the_fetch(hub: FakeHub, tmp_path: Path) -> None:
    """vLLM's download_dir: the model and its tokenizer fetched there, in the cache's layout, not in
    HF_HOME."""
    download_dir = tmp_path / "models"
    env = hub_env(hub, tmp_path / "hf-home")
    lines = _resolved(env, model=REPO_ID, tokenizer=REPO_ID, download_dir=str(download_dir))
    snapshot = download_dir / "models--org--tiny" / "snapshots" / hub.commit
    assert [Path(line) for line in lines[:2]] == [snapshot, snapshot]
    assert (snapshot / "config.json").read_bytes() == hub.files["config.json"]
    assert not (tmp_path / "hf-home" / "hub").exists()


def test_hf_token_fetches_a_private_repository(hub: FakeHub, tmp_path: Path) -> None:
    """vLLM's hf_token (`--hf-token`): sent as the Hub's bearer token, for the model and its tokenizer, and
    kept out of the config's repr."""
    env = hub_env(hub, tmp_path / "hf-home")
    model, tokenizer, config = _resolved(env, model=PRIVATE_ID, tokenizer=PRIVATE_ID, hf_token=TOKEN)
    snapshot = tmp_path / "hf-home" / "hub" / "models--org--private" / "snapshots" / hub.commit
    assert [Path(model), Path(tokenizer)] == [snapshot, snapshot]
    assert (snapshot / "config.json").read_bytes() == hub.files["config.json"]
    assert TOKEN not in config and "hf_token=" not in config


@pytest.mark.parametrize(
    ("model", "revision", "offline", "words"),
    [
        (REPO_ID, "v2", False, "cannot download org/tiny: the repository has no revision 'v2'"),
        ("org/missing", REVISION, False, "cannot download org/missing: no repository of that name"),
        (PRIVATE_ID, REVISION, False, "(a private one needs HF_TOKEN or --hf-token)"),
        ("acme/some-model", None, True, "HF_HUB_OFFLINE is set and the Hugging Face cache"),
    ],
)
def test_what_the_hub_lacks_fails_in_one_line_before_listening(
    hub: FakeHub, tmp_path: Path, model: str, revision: str | None, offline: bool, words: str
) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-P",
        "-m",
        "kvfleet",
        "serve",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    command += ["--revision", revision] if revision else []
    env = hub_env(hub, tmp_path / "hf", **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    start = time.monotonic()
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert time.monotonic() - start < 5
    assert completed.returncode != 0
    lines = [line for line in (completed.stdout + completed.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_download_model_fetches_into_its_folder(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    command = [sys.executable, "-P", "-m", "kvfleet", "download-model", REPO_ID, "--revision", REVISION]
    env = hub_env(hub, tmp_path / "hf")
    subprocess.run([*command, "--dest", str(dest)], env=env, capture_output=True, timeout=60, check=True)
    fetched = {path.name: path.read_bytes() for path in dest.iterdir() if path.is_file()}
    assert fetched == {name: data for name, data in hub.files.items() if name != EXTRA_FILE}
