"""The runtime image run as the operator's pods run it: the pod that examples/tiny-cpu.yaml renders to (its
securityContext, read-only root, uid 1000, the model folder mounted read-only, its scratch and shared-memory
volumes, environment and `kvfleet serve` command), chatted with through the openai SDK, then drained by
SIGTERM."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvfleet.operator.api import HTTP_PORT
from kvfleet.operator.render_pod import RUNTIME_USER

from e2e.fleet.manifests import tiny_example
from images.tests.conftest import PodContainer, host_volumes, runtime_pod

# Loading torch and the model on 2 busy cores.
STARTUP_SECONDS = 300.0


@pytest.fixture(scope="module")
def served_name(tiny_model_dir: Path) -> str:
    return tiny_example(tiny_model_dir)["spec"]["model"]["servedName"]


@pytest.fixture
def server(runtime_image: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[PodContainer]:
    pod = runtime_pod(runtime_image, tiny_model_dir)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == runtime_image
    with PodContainer(runtime_image, pod, container, host_volumes(pod["spec"], tmp_path)) as running:
        running.wait_http(HTTP_PORT, "/ready", STARTUP_SECONDS)
        yield running


def test_the_pod_runs_as_its_user_on_a_read_only_root_with_the_model_read_only(
    server: PodContainer, tiny_model_dir: Path
) -> None:
    identity = server.exec("id", "-u")
    assert identity.stdout.strip() == str(RUNTIME_USER)
    for path in ("/home/kvfleet/written", "/usr/local/lib/written", f"{tiny_model_dir}/written"):
        attempt = server.exec("touch", path)
        assert attempt.returncode != 0 and "Read-only file system" in attempt.stderr, (path, attempt)
    assert server.exec("touch", "/scratch/written").returncode == 0, "HOME and TMPDIR are the scratch volume"


def test_the_openai_sdk_chats_with_the_pod_and_sigterm_drains_it(
    server: PodContainer, served_name: str
) -> None:
    base_url = f"http://{server.pod_ip}:{HTTP_PORT}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(
            model=served_name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
        assert answer.model == served_name
        assert isinstance(answer.choices[0].message.content, str)
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 8

        # A streamed answer in flight when SIGTERM arrives is finished, then the server exits with 0.
        streamed: list[str] = []
        finish: list[str | None] = []
        first_chunk = threading.Event()

        def stream() -> None:
            chunks = client.chat.completions.create(
                model=served_name,
                messages=[{"role": "user", "content": "Count to a hundred."}],
                max_tokens=64,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                first_chunk.set()
                for choice in chunk.choices:
                    streamed.append(choice.delta.content or "")
                    if choice.finish_reason is not None:
                        finish.append(choice.finish_reason)

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(120), server.logs()
        server.signal("SIGTERM")
        reader.join(120)
        assert not reader.is_alive()
    assert finish == ["length"], f"the stream in flight at SIGTERM was cut short:\n{server.logs()}"
    assert server.wait() == 0, server.logs()
