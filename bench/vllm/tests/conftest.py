"""Fixtures of the vLLM-runtime test (`make test-vllm-runtime`): a local control plane whose pod runner runs
the pods of `runtime: vllm` services with vLLM's CPU build, the chart installed with its gateway, and the
`small` model made by `kvfleet make-model`.

VLLM_PYTHON names the python of vLLM's own environment (the target sets it); the pods' `vllm` command runs
vllm_command.py with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvfleet.operator.render import DEFAULT_VLLM_IMAGE

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from e2e.cluster import ClusterConfig, LocalCluster, ensure_binaries  # noqa: E402
from e2e.cluster.pod_spec import DEFAULT_IMAGE_PATTERN  # noqa: E402
from e2e.fleet.chart import OperatorRelease, install_chart, uninstall_chart  # noqa: E402
from e2e.fleet.gateway import gateway_endpoints  # noqa: E402
from e2e.fleet.traffic import ReadyEndpoints  # noqa: E402
from e2e.support.waits import wait_for  # noqa: E402

VLLM_COMMAND = Path(__file__).with_name("vllm_command.py")


@pytest.fixture(scope="session")
def vllm_program(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The `vllm` command the pod runner runs for the image's own."""
    python = os.environ.get("VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.fail("set VLLM_PYTHON to the python of vLLM's environment (make test-vllm-runtime does)")
    # vLLM's processes talk over IPC sockets in its temporary folder, the pod's scratch volume; here that is a
    # folder deep in the cluster's, past the 107 characters a socket's path may have.
    sockets = tmp_path_factory.mktemp("ipc")
    path = tmp_path_factory.mktemp("programs") / "vllm"
    path.write_text(f'#!/bin/sh\nVLLM_RPC_BASE_PATH="{sockets}" exec "{python}" -P "{VLLM_COMMAND}" "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="session")
def make_small_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`kvfleet make-model`'s small Llama (head size 64, which vLLM's CPU attention takes; the tiny model's 16
    it does not) with its tokenizer, in a folder of its own named `name`, made with `options` too."""

    def make(name: str, *options: str) -> Path:
        path = tmp_path_factory.mktemp("models") / name
        kvfleet = Path(sys.executable).parent / "kvfleet"
        command = [str(kvfleet), "make-model", "--arch", "llama", "--preset", "small", *options, str(path)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        return path

    return make


@pytest.fixture(scope="session")
def small_model_dir(make_small_model: Callable[..., Path]) -> Path:
    return make_small_model("small")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, vllm_program: str) -> Iterator[LocalCluster]:
    """One node whose pod runner runs kvfleet's pods and, as local processes too, vLLM's image's."""
    vllm_image = "^" + DEFAULT_VLLM_IMAGE.replace(".", r"\.") + "$"
    config = ClusterConfig(nodes=1, runner_image_pattern=f"{DEFAULT_IMAGE_PATTERN}|{vllm_image}")
    state_dir = tmp_path_factory.mktemp("local-cluster")
    programs = {"vllm": vllm_program}
    with LocalCluster(state_dir, config, bin_dir=ensure_binaries(), runner_programs=programs) as running:
        yield running


@pytest.fixture(scope="session")
def release(cluster: LocalCluster) -> Iterator[OperatorRelease]:
    """The chart with its gateway; the services' own vLLM flags (extraArgs) are not the chart's to list."""
    installed = install_chart(
        cluster, {"gateway.enabled": "true", "admissionPolicy.allowedExtraArgs": "null"}
    )
    yield installed
    uninstall_chart(installed)


@pytest.fixture(scope="session")
def gateway(cluster: LocalCluster, release: OperatorRelease) -> Iterator[ReadyEndpoints]:
    with gateway_endpoints(cluster, release.namespace) as endpoints:
        wait_for("a ready gateway replica", endpoints.refresh, 60)
        yield endpoints
