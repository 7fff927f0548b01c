"""A pod's container as `podman run` options (pure functions; `make test-images` runs them for real)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from kvfleet.operator.render import Owner, RenderOptions, render_deployment
from kvfleet.operator.spec import parse_spec

from e2e.cluster.pod_container import (
    UnsupportedPodSpec,
    container_command,
    podman_run_options,
    security_options,
)
from e2e.fleet.chart import CHART_DIR, OPERATOR_CONTAINER
from e2e.fleet.manifests import tiny_example

RESTRICTED = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_the_container_context_overrides_the_pod_context_as_a_kubelet_merges_them() -> None:
    container = {
        "securityContext": {
            "runAsUser": 2000,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        }
    }
    options = security_options({"securityContext": RESTRICTED}, container, image_user="")
    assert options == [
        "--user", "2000:1000",
        "--group-add", "1000",
        "--read-only", "--read-only-tmpfs=false",
        "--security-opt", "no-new-privileges",
        "--cap-drop=all",
        "--cap-add=net_bind_service",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("pod_context", "image_user", "verified"),
    [
        ({"runAsNonRoot": True}, "1000:1000", True),
        ({"runAsNonRoot": True}, "kvfleet", False),  # a name cannot be checked without the image's passwd
        ({"runAsNonRoot": True}, "", False),  # root
        ({"runAsNonRoot": True, "runAsUser": 0}, "1000", False),
    ],
)
def test_run_as_non_root_is_verified_like_a_kubelet(
    pod_context: dict, image_user: str, verified: bool
) -> None:
    pod_spec = {"securityContext": pod_context}
    if verified:
        security_options(pod_spec, {}, image_user)
    else:
        with pytest.raises(UnsupportedPodSpec, match="runAsNonRoot"):
            security_options(pod_spec, {}, image_user)


@pytest.mark.parametrize(
    "container_context",
    [{"seLinuxOptions": {"level": "s0"}}, {"seccompProfile": {"type": "Localhost", "localhostProfile": "x"}}],
)
def test_a_context_without_a_podman_equivalent_is_refused(container_context: dict) -> None:
    with pytest.raises(UnsupportedPodSpec):
        security_options({}, {"securityContext": container_context}, image_user="1000")


def test_the_operator_rendered_runtime_pod_becomes_podman_options(tmp_path: Path) -> None:
    manifest = tiny_example(tmp_path / "model")
    spec = parse_spec(manifest["spec"], name="tiny")
    deployment = render_deployment(Owner("tiny", "ns", "uid"), spec, 1, RenderOptions(runtime_image="img"))
    pod_spec = deployment["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    volumes = {"scratch": tmp_path / "scratch", "model": tmp_path / "model"}
    options = podman_run_options(pod_spec, container, {"HOME": "/scratch"}, volumes, image_user="1000:1000")
    assert "--read-only" in options and options[options.index("--user") + 1] == "1000:1000"
    assert f"{tmp_path / 'model'}:{tmp_path / 'model'}:ro" in options, "the model folder is mounted read-only"
    assert f"{tmp_path / 'scratch'}:/scratch:rw" in options
    assert "type=tmpfs,destination=/dev/shm,tmpfs-mode=1777" in options, "the memory emptyDir"
    assert options[options.index("--memory") + 1] == str(2 * 1024**3)
    entrypoint, args = container_command(container, {}, "127.9.0.2", image_entrypoint=["kvfleet"])
    assert entrypoint == ["--entrypoint", '["kvfleet"]']
    assert args[0] == "serve" and args[args.index("--host") + 1] == "127.9.0.2"


def test_a_volume_without_a_host_folder_is_refused() -> None:
    pod_spec = {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}
    container = {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    with pytest.raises(UnsupportedPodSpec, match="data"):
        podman_run_options(pod_spec, container, {}, {}, image_user="1000")


def test_the_chart_operator_pod_becomes_podman_options(cluster_bin_dir: Path) -> None:
    """The chart's securityContext as `helm template` renders it: every field has its podman option."""
    rendered = subprocess.run(
        [str(cluster_bin_dir / "helm"), "template", "kv", str(CHART_DIR), "--namespace", "ops"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (deployment,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
    pod_spec = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod_spec["containers"] if c["name"] == OPERATOR_CONTAINER]
    options = security_options(pod_spec, container, image_user="1000:1000")
    assert options[options.index("--user") + 1] == "1000:1000"
    for option in ("--read-only", "--read-only-tmpfs=false", "no-new-privileges", "--cap-drop=all"):
        assert option in options
