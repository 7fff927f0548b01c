"""Fixtures of the image tests: the images `make images` built, and containers run from them as pods are.

The tests run the images with podman on the host network, each container on a loopback address of its own
(as the end-to-end pod runner gives each pod one), and stop every container they start by its name.
"""

from __future__ import annotations

import random
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kvfleet.operator.render import Owner, RenderOptions, render_deployment
from kvfleet.operator.spec import parse_spec

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from e2e.cluster.pod_container import container_command, image_config, podman_run_options  # noqa: E402
from e2e.cluster.pod_spec import container_env  # noqa: E402
from e2e.fleet.manifests import tiny_example  # noqa: E402
from images.build import image_name, podman, run_limits  # noqa: E402


def podman_output(*args: str) -> str:
    return subprocess.run(podman(*args), check=True, capture_output=True, text=True).stdout


def _built(target: str) -> str:
    image = image_name(target)
    if subprocess.run(podman("image", "exists", image)).returncode != 0:
        pytest.fail(f"{image} is not built: run `make images` first")
    return image


@pytest.fixture(scope="session")
def runtime_image() -> str:
    return _built("runtime")


@pytest.fixture(scope="session")
def operator_image() -> str:
    return _built("operator")


def loopback_address() -> str:
    """An address of 127.0.0.0/8 for one container (a pod's IP): its ports clash with nobody's."""
    return f"127.{random.randint(64, 250)}.{random.randint(0, 255)}.{random.randint(2, 254)}"


def no_objects(kind: str, namespace: str, name: str) -> None:
    """The ConfigMap and Secret lookup of a pod that runs outside any cluster: there are none."""
    return None


class PodContainer:
    """One container of a pod, run with podman as a kubelet would run it (e2e/cluster/pod_container.py)."""

    def __init__(
        self,
        image: str,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        volume_dirs: Mapping[str, Path],
        extra_env: Mapping[str, str] | None = None,
        extra_volumes: Mapping[Path, str] | None = None,
    ) -> None:
        self.image = image
        self.pod_ip: str = pod["status"]["podIP"]
        self.name = f"kvfleet-test-{secrets.token_hex(4)}"
        config = image_config(image)
        env = {**container_env(pod, container, no_objects, {}), **(extra_env or {})}
        options = podman_run_options(pod["spec"], container, env, volume_dirs, config.get("User", ""))
        for host, path in (extra_volumes or {}).items():
            options += ["--volume", f"{host}:{path}:ro"]
        entrypoint, args = container_command(container, env, self.pod_ip, config.get("Entrypoint") or [])
        self.argv = podman("run", "--detach", "--name", self.name, "--network", "host", *run_limits())
        self.argv += [*options, *entrypoint, image, *args]

    def __enter__(self) -> PodContainer:
        subprocess.run(self.argv, check=True, capture_output=True, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(podman("rm", "--force", "--time", "5", self.name), capture_output=True)

    def running(self) -> bool:
        return (
            podman_output("container", "inspect", "--format", "{{.State.Running}}", self.name).strip()
            == "true"
        )

    def logs(self) -> str:
        result = subprocess.run(podman("logs", self.name), capture_output=True, text=True)
        return (result.stdout + result.stderr)[-6000:]

    def signal(self, name: str) -> None:
        subprocess.run(podman("kill", "--signal", name, self.name), check=True, capture_output=True)

    def wait(self) -> int:
        """Waits for the container to exit; returns its exit code."""
        return int(podman_output("wait", self.name).strip())

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(podman("exec", self.name, *argv), capture_output=True, text=True)

    def wait_http(self, port: int, path: str, timeout: float) -> None:
        """Until GET path answers 200 (a probe); fails with the container's log if it exits first."""
        deadline = time.monotonic() + timeout
        url = f"http://{self.pod_ip}:{port}{path}"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if not self.running():
                pytest.fail(f"{self.image} exited before {path} answered:\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{url} did not answer 200 within {timeout:.0f}s:\n{self.logs()}")
            time.sleep(1.0)


def runtime_pod(image: str, model_dir: Path) -> dict[str, Any]:
    """The pod of the tiny example's Deployment, as the operator renders it, with an IP."""
    manifest = tiny_example(model_dir)
    name = manifest["metadata"]["name"]
    spec = parse_spec(manifest["spec"], name=name)
    deployment = render_deployment(
        Owner(name, "images", "0" * 8), spec, 1, RenderOptions(runtime_image=image)
    )
    template = deployment["spec"]["template"]
    metadata = {**template["metadata"], "name": f"{name}-0", "namespace": "images", "uid": "0" * 8}
    return {"metadata": metadata, "spec": template["spec"], "status": {"podIP": loopback_address()}}


def host_volumes(pod_spec: Mapping[str, Any], root: Path) -> dict[str, Path]:
    """Host folders for a pod's emptyDir (world-writable, as a kubelet makes them) and hostPath volumes."""
    folders: dict[str, Path] = {}
    for volume in pod_spec.get("volumes", []):
        if "hostPath" in volume:
            folders[volume["name"]] = Path(volume["hostPath"]["path"])
        elif "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory":
            folder = root / volume["name"]
            folder.mkdir(parents=True)
            folder.chmod(0o777)
            folders[volume["name"]] = folder
    return folders


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama made by `kvfleet make-model` on the host, readable by the images' user."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    kvfleet = Path(sys.executable).parent / "kvfleet"
    command = [str(kvfleet), "make-model", "--arch", "llama", "--preset", "tiny", str(path)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return path
