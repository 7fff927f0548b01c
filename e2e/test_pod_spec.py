"""How the pod runner reads pod specs: pure functions, no cluster needed."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from e2e.cluster.fake_nodes import GPU_RESOURCE, NodeShape, fake_node, fake_node_names
from e2e.cluster.kwok_stages import kwok_stages, runs_image_expression
from e2e.cluster.pod_spec import (
    DEFAULT_IMAGE_PATTERN,
    ContainerConfigError,
    bind_to_pod_ip,
    container_argv,
    container_env,
    container_mounts,
    container_port,
    cpu_threads,
    expand_references,
    host_path,
    parse_quantity,
    runs_image,
    secret_strings,
)
from e2e.cluster.probes import Probe, ProbeTracker, parse_probe

POD = {
    "metadata": {"name": "web-0", "namespace": "team", "uid": "u-1", "labels": {"app": "web"}},
    "spec": {"nodeName": "kwok-gpu-1", "serviceAccountName": "runner"},
    "status": {"podIP": "127.1.0.7", "hostIP": "127.0.0.1", "podIPs": [{"ip": "127.1.0.7"}]},
}


@pytest.mark.parametrize(
    ("image", "runs"),
    [
        ("kvfleet", True),
        ("kvfleet:0.1.0", True),
        ("registry.example/acme/kvfleet:v1", True),
        ("registry.local:5000/kvfleet@sha256:" + "a" * 64, True),
        ("kvfleet/operator:0.1.0", True),
        ("registry.example/kvfleet/runtime:0.1.0", True),
        ("kvfleet/other:1", False),
        ("registry.example/acme/kvfleet-operator:v1", False),
        ("notkvfleet:1", False),
        ("busybox", False),
    ],
)
def test_runner_image_pattern(image: str, runs: bool) -> None:
    assert runs_image(image, DEFAULT_IMAGE_PATTERN) is runs


def test_references_expand_like_kubernetes() -> None:
    variables = {"MODEL": "tiny", "PORT": "8000"}
    assert expand_references("--model=/m/$(MODEL)", variables) == "--model=/m/tiny"
    assert expand_references("$(UNKNOWN) stays", variables) == "$(UNKNOWN) stays"
    assert expand_references("$$(MODEL) is escaped, $$ too", variables) == "$(MODEL) is escaped, $ too"


def test_env_from_values_fields_resources_and_objects() -> None:
    objects = {
        ("ConfigMap", "team", "settings"): {"level": "debug"},
        ("Secret", "team", "keys"): {"api": "s3cret"},
    }
    container = {
        "name": "server",
        "resources": {"limits": {"cpu": "1500m", "memory": "2Gi"}},
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api"}}},
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {
                "name": "MEM_MI",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "GPUS", "valueFrom": {"resourceFieldRef": {"resource": f"limits.{GPU_RESOURCE}"}}},
            {"name": "URL", "value": "http://$(POD_IP):8000"},
            {
                "name": "MISSING",
                "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "x", "optional": True}},
            },
        ],
    }
    env = container_env(
        POD, container, lambda kind, ns, name: objects.get((kind, ns, name)), {GPU_RESOURCE: "8"}
    )
    assert env == {
        "CFG_level": "debug",
        "POD_IP": "127.1.0.7",
        "APP": "web",
        "KEY": "s3cret",
        "CPUS": "2",  # whole cores, rounded up, as the downward API does
        "MEM_MI": "2048",
        "GPUS": "8",  # no limit set: the node's allocatable
        "URL": "http://127.1.0.7:8000",
    }


def test_missing_required_object_is_a_config_error() -> None:
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}],
    }
    with pytest.raises(ContainerConfigError, match="Secret team/absent not found"):
        container_env(POD, container, lambda kind, ns, name: None, {})


def test_argv_maps_the_image_commands_and_rejects_others() -> None:
    programs = {"kvfleet": "/venv/bin/kvfleet"}
    assert container_argv({"args": ["serve", "--port", "$(PORT)"]}, {"PORT": "9"}, programs) == [
        "/venv/bin/kvfleet",
        "serve",
        "--port",
        "9",
    ]
    assert (
        container_argv({"command": ["/usr/local/bin/kvfleet", "operator"]}, {}, programs)[0]
        == "/venv/bin/kvfleet"
    )
    with pytest.raises(ContainerConfigError, match="'sh' is not a command"):
        container_argv({"command": ["sh", "-c", "true"]}, {}, programs)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["k", "serve", "--host", "0.0.0.0", "--port", "8000"],
            ["k", "serve", "--host", "127.1.0.7", "--port", "8000"],
        ),
        (["k", "serve", "--host=0.0.0.0"], ["k", "serve", "--host=127.1.0.7"]),
        (["k", "serve", "--port", "8000"], ["k", "serve", "--port", "8000", "--host", "127.1.0.7"]),
        (["k", "operator", "--namespace", "x"], ["k", "operator", "--namespace", "x", "--bind", "127.1.0.7"]),
        (["k", "operator", "--bind=0.0.0.0"], ["k", "operator", "--bind=127.1.0.7"]),
        (["k", "operator", "--bind", "127.0.0.1"], ["k", "operator", "--bind", "127.1.0.7"]),
        (
            ["k", "--log-level", "info", "gateway"],
            ["k", "--log-level", "info", "gateway", "--host", "127.1.0.7"],
        ),
        (
            ["k", "sidecar", "--liveness=http://0.0.0.0:8080/healthz", "--metrics", "0.0.0.0:9090"],
            ["k", "sidecar", "--liveness=http://127.1.0.7:8080/healthz", "--metrics", "127.1.0.7:9090"],
        ),
        (["k", "sidecar", "--peer", "10.0.0.0.1"], ["k", "sidecar", "--peer", "10.0.0.0.1"]),
    ],
)
def test_servers_bind_to_the_pod_ip(argv: list[str], expected: list[str]) -> None:
    assert bind_to_pod_ip(argv, "127.1.0.7") == expected


def test_container_paths_map_to_volume_folders(tmp_path: Path) -> None:
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "models", "mountPath": "/models"},
            {"name": "config", "mountPath": "/models/config", "subPath": "serving"},
        ],
    }
    mounts = container_mounts(container, {"models": tmp_path / "m", "config": tmp_path / "c"})
    assert host_path("/models/tiny", mounts) == f"{tmp_path}/m/tiny"
    assert host_path("/models/config/a.json", mounts) == f"{tmp_path}/c/serving/a.json"  # longest mount wins
    assert host_path("--model=/models", mounts) == f"--model={tmp_path}/m"
    assert host_path("file:///models/tiny", mounts) == f"file://{tmp_path}/m/tiny"
    assert host_path("/modelsx", mounts) == "/modelsx"
    assert host_path("relative/models", mounts) == "relative/models"
    with pytest.raises(ContainerConfigError, match="not provided"):
        container_mounts({"name": "c", "volumeMounts": [{"name": "pvc", "mountPath": "/data"}]}, {})


def test_quantities_ports_threads_and_secrets() -> None:
    assert parse_quantity("500m") * 2 == 1
    assert parse_quantity("1Gi") == 1024**3
    assert parse_quantity("2k") == 2000
    with pytest.raises(ContainerConfigError):
        parse_quantity("lots")
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}
    assert container_port(container, "http") == 8000
    assert container_port(container, 9000) == 9000
    with pytest.raises(ContainerConfigError, match="no port named 'grpc'"):
        container_port(container, "grpc")
    assert cpu_threads({"resources": {"requests": {"cpu": "250m"}}}) == 1
    assert cpu_threads({"resources": {"limits": {"cpu": "3"}}}) == 3
    assert cpu_threads({}) is None
    secret = {"data": {"a": base64.b64encode(b"x").decode()}, "stringData": {"b": "y"}}
    assert secret_strings(secret) == {"a": "x", "b": "y"}


def test_probe_defaults_and_thresholds() -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}
    probe = parse_probe({"httpGet": {"path": "/ready", "port": "http"}}, container, "127.1.0.7")
    assert probe == Probe(kind="http", host="127.1.0.7", port=8000, path="/ready")
    assert parse_probe(None, container, "127.1.0.7") is None
    with pytest.raises(ContainerConfigError, match="unsupported probe"):
        parse_probe({"grpc": {"port": 9}}, container, "127.1.0.7")

    readiness = ProbeTracker(Probe(kind="http", host="h", success_threshold=2, failure_threshold=2), False)
    assert not readiness.record(True, "", 0.0) and not readiness.healthy  # one success is not enough
    assert readiness.record(True, "", 1.0) and readiness.healthy
    assert not readiness.record(False, "", 2.0) and readiness.healthy
    assert readiness.record(False, "", 3.0) and not readiness.healthy
    liveness = ProbeTracker(Probe(kind="tcp", host="h", failure_threshold=1), True)
    assert liveness.healthy and liveness.record(False, "refused", 0.0) and not liveness.healthy


def test_fake_nodes_advertise_gpus() -> None:
    node = fake_node("kwok-gpu-0", NodeShape(gpus=4))
    assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert node["status"]["allocatable"][GPU_RESOURCE] == "4"
    assert "podCIDR" not in node["spec"]
    assert GPU_RESOURCE not in fake_node("cpu-only", NodeShape(gpus=0))["status"]["capacity"]
    assert fake_node_names(2) == ["kwok-gpu-0", "kwok-gpu-1"]
    with pytest.raises(ValueError):
        fake_node_names(0)


def test_kwok_leaves_runner_pods_to_the_runner() -> None:
    with_runner = {stage["metadata"]["name"]: stage for stage in kwok_stages(DEFAULT_IMAGE_PATTERN)}
    without_runner = {stage["metadata"]["name"]: stage for stage in kwok_stages(None)}
    assert "pod-address" in with_runner and "pod-address" not in without_runner
    runs = runs_image_expression(DEFAULT_IMAGE_PATTERN)
    for name in ("pod-running", "pod-delete"):
        expressions = with_runner[name]["spec"]["selector"]["matchExpressions"]
        assert {"key": runs, "operator": "NotIn", "values": ["true"]} in expressions
        assert all(e["key"] != runs for e in without_runner[name]["spec"]["selector"]["matchExpressions"])
    # The jq expression embeds the same regular expression the runner uses.
    assert f'test("{DEFAULT_IMAGE_PATTERN}")' in runs
