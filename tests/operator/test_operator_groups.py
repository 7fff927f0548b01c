"""Models that span nodes: the spec's sizes, the groups rendered for each backend, and what the pods of a
group are told.

The control loop's handling of groups is in test_operator_controller.py, their status in
test_operator_status.py.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfleet.operator.api import (
    GROUP_LABEL,
    LWS_GROUP_INDEX_LABEL,
    LWS_WORKER_INDEX_LABEL,
    POD_INDEX_LABEL,
    SERVICE_LABEL,
)
from kvfleet.operator.observed import pod_view
from kvfleet.operator.render import Owner, RenderOptions, render_children
from kvfleet.operator.render_pod import HTTP_PORT, NODE_RANK_ENV, POD_IP_ENV, RANK_READINESS_SCRIPT
from kvfleet.operator.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
OWNER = Owner("big", "serving", "uid-1")
OPTIONS = RenderOptions(runtime_image="kvfleet/runtime:0.1.0")


def spec(engine: dict[str, Any], resources: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {"model": {"uri": "file:///models/big"}, "engine": engine, "resources": resources, **sections}


def children_of(raw: dict[str, Any], replicas: int = 2, name: str = "big") -> list[dict[str, Any]]:
    owner = Owner(name, "serving", "uid-1")
    return render_children(owner, parse_spec(raw, name=name), replicas, OPTIONS)


def of_kind(children: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [child for child in children if child["kind"] == kind]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize(
    ("engine", "resources", "gpus", "nodes"),
    [
        ({"tensorParallelSize": 2, "pipelineParallelSize": 2}, {}, 4, 1),
        ({"tensorParallelSize": 4}, {"gpusPerNode": 8}, 4, 1),
        ({"tensorParallelSize": 4, "pipelineParallelSize": 2}, {"gpusPerNode": 4}, 4, 2),
        ({"tensorParallelSize": 8, "pipelineParallelSize": 2}, {"gpusPerNode": 4, "gpus": 4}, 4, 4),
        ({"tensorParallelSize": 2}, {"gpusPerNode": 1}, 1, 2),
    ],
)
def test_ranks_fit_one_pod_or_split_evenly_over_nodes(
    engine: dict[str, Any], resources: dict[str, Any], gpus: int, nodes: int
) -> None:
    parsed = parse_spec(spec(engine, resources), name="big")
    assert (parsed.resources.gpus, parsed.resources.nodes) == (gpus, nodes)
    assert parsed.grouped == (nodes > 1)
    assert parsed.engine.world_size == gpus * nodes or nodes == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            spec({"tensorParallelSize": 2, "pipelineParallelSize": 2}, {"gpus": 2}),
            "spec.resources.gpus (2) must be at least spec.engine.tensorParallelSize × pipelineParallelSize "
            "(2 × 2 = 4); set spec.resources.gpusPerNode to split the model over several nodes",
        ),
        (
            spec({"tensorParallelSize": 3, "pipelineParallelSize": 2}, {"gpusPerNode": 4}),
            "spec.engine.tensorParallelSize × pipelineParallelSize (3 × 2 = 6) must be a multiple of "
            "spec.resources.gpusPerNode (4)",
        ),
        (
            spec({"tensorParallelSize": 4}, {"gpusPerNode": 2, "gpus": 4}),
            "spec.resources.gpus (4) must equal spec.resources.gpusPerNode (2) when the model spans nodes "
            "(4 ranks over 2 nodes of 2 GPUs)",
        ),
        (
            spec({"tensorParallelSize": 2}, {"gpusPerNode": 4, "gpus": 8}),
            "spec.resources.gpus (8) must not exceed spec.resources.gpusPerNode (4)",
        ),
        (
            spec({"tensorParallelSize": 2}, {"gpusPerNode": 1}, batch={}, scaling={"replicas": 1}),
            "spec.batch needs a replica on one node; this model spans 2 nodes",
        ),
        (spec({"pipelineParallelSize": 0}, {}), "spec.engine.pipelineParallelSize must be at least 1"),
        (spec({}, {"gpusPerNode": 0}), "spec.resources.gpusPerNode must be at least 1"),
        (
            spec({}, {}, scaling={"groupBackend": "jobset"}),
            "spec.scaling.groupBackend must be one of statefulset, leaderworkerset",
        ),
    ],
)
def test_sizes_that_do_not_fit_are_refused_with_their_numbers(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec(raw, name="big")
    assert raised.value.reason == "InvalidSpec"
    assert message in raised.value.message


def test_group_names_must_leave_room_for_the_statefulset_revision_label() -> None:
    raw = spec({"tensorParallelSize": 2}, {"gpusPerNode": 1}, scaling={"maxReplicas": 10})
    parse_spec(raw, name="n" * 50)  # the last group, n...n-9, has 52 characters
    with pytest.raises(SpecError, match=r"the group n+-9 must be at most 52 characters"):
        parse_spec(raw, name="n" * 51)
    raw["scaling"]["groupBackend"] = "leaderworkerset"
    with pytest.raises(SpecError, match="-ranks-9 must be at most 52"):
        parse_spec(raw, name="n" * 50)
    # One pod per replica: the full 63 characters remain.
    parse_spec(spec({"tensorParallelSize": 2}, {}), name="n" * 63)


def test_ranks_on_one_pod_take_every_gpu_with_both_parallel_flags() -> None:
    children = children_of(spec({"tensorParallelSize": 2, "pipelineParallelSize": 2}, {}))
    assert [child["kind"] for child in children] == ["Deployment", "Service", "PodDisruptionBudget"]
    container = of_kind(children, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert (
        flag(container["args"], "--tensor-parallel-size"),
        flag(container["args"], "--pipeline-parallel-size"),
    ) == (
        "2",
        "2",
    )
    assert "--nnodes" not in container["args"]
    assert of_kind(children, "Service")[0]["spec"]["selector"] == {SERVICE_LABEL: "big"}


def test_the_multinode_example_renders_a_statefulset_per_group() -> None:
    doc = next(
        d for d in yaml.safe_load_all((REPO / "examples" / "llama-70b-multinode.yaml").read_text()) if d
    )
    children = render_children(
        Owner("llama-70b", "serving", "uid-1"), parse_spec(doc["spec"], name="llama-70b"), 2, OPTIONS
    )
    assert [child["kind"] for child in children] == [
        "StatefulSet",
        "StatefulSet",
        "Service",
        "Service",
        "PodDisruptionBudget",
    ]
    first, second = of_kind(children, "StatefulSet")
    rendezvous, serving = of_kind(children, "Service")
    assert (first["metadata"]["name"], second["metadata"]["name"]) == ("llama-70b-0", "llama-70b-1")
    for index, group in enumerate((first, second)):
        group_spec = group["spec"]
        assert group_spec["replicas"] == 2, "8 ranks over nodes of 4 GPUs"
        assert group_spec["podManagementPolicy"] == "Parallel"
        assert group_spec["updateStrategy"] == {"type": "OnDelete"}
        assert group_spec["serviceName"] == rendezvous["metadata"]["name"] == "llama-70b-ranks"
        labels = group_spec["template"]["metadata"]["labels"]
        selector = group_spec["selector"]["matchLabels"]
        assert selector == {SERVICE_LABEL: "llama-70b", GROUP_LABEL: str(index)}
        assert selector.items() <= labels.items(), "a StatefulSet's selector must match its template"
        pod = group_spec["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert (flag(args, "--tensor-parallel-size"), flag(args, "--pipeline-parallel-size")) == ("4", "2")
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--node-rank") == f"$({NODE_RANK_ENV})"
        assert flag(args, "--master-addr") == f"llama-70b-{index}-0.llama-70b-ranks.serving.svc.cluster.local"
        assert flag(args, "--master-port") == "29500"
        env = {item["name"]: item for item in container["env"]}
        assert (
            env[NODE_RANK_ENV]["valueFrom"]["fieldRef"]["fieldPath"]
            == f"metadata.labels['{POD_INDEX_LABEL}']"
        )
        assert env[POD_IP_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert container["readinessProbe"]["exec"]["command"] == ["python", "-c", RANK_READINESS_SCRIPT]
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["startupProbe"]["httpGet"]["path"] == "/health"
        assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in container["ports"]
        assert pod["initContainers"][0]["command"] == ["kvfleet", "download-model"], (
            "every node loads weights"
        )
    assert rendezvous["spec"]["clusterIP"] == "None"
    assert rendezvous["spec"]["publishNotReadyAddresses"] is True
    assert rendezvous["spec"]["selector"] == {SERVICE_LABEL: "llama-70b"}
    assert serving["metadata"]["name"] == "llama-70b"
    assert serving["spec"]["selector"] == {SERVICE_LABEL: "llama-70b", POD_INDEX_LABEL: "0"}


def test_leaderworkerset_backend_renders_one_set_of_groups() -> None:
    raw = spec({"tensorParallelSize": 4}, {"gpusPerNode": 2}, scaling={"groupBackend": "leaderworkerset"})
    children = children_of(raw, replicas=3)
    assert [child["kind"] for child in children] == ["LeaderWorkerSet", "Service", "PodDisruptionBudget"]
    (lws,) = of_kind(children, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "big-ranks"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert lws["spec"]["replicas"] == 3, "replicas count groups"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    for role, readiness in (("leaderTemplate", "/ready"), ("workerTemplate", "/health")):
        (container,) = template[role]["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == readiness
        assert flag(container["args"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(container["args"], "--nnodes") == "2"
        env = {item["name"]: item for item in container["env"]}
        rank_field = env[NODE_RANK_ENV]["valueFrom"]["fieldRef"]["fieldPath"]
        assert rank_field == f"metadata.labels['{LWS_WORKER_INDEX_LABEL}']"
        assert POD_IP_ENV not in env, "the HTTP probes need no address"
    serving = of_kind(children, "Service")[0]
    assert serving["spec"]["selector"] == {SERVICE_LABEL: "big", LWS_WORKER_INDEX_LABEL: "0"}


def test_pods_know_their_group_and_rank_from_the_labels_the_controllers_set() -> None:
    def view(labels: dict[str, str]) -> tuple[int | None, int | None, bool]:
        body = {
            "metadata": {"name": "p", "labels": {SERVICE_LABEL: "big", **labels}},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        pod = pod_view(body)
        return pod.group, pod.rank, pod.scrapeable

    assert view({}) == (None, None, True)
    assert view({GROUP_LABEL: "3", POD_INDEX_LABEL: "0"}) == (3, 0, True)
    assert view({GROUP_LABEL: "3", POD_INDEX_LABEL: "1"}) == (3, 1, False)
    assert view({LWS_GROUP_INDEX_LABEL: "2", LWS_WORKER_INDEX_LABEL: "0"}) == (2, 0, True)
    assert view({LWS_GROUP_INDEX_LABEL: "2", LWS_WORKER_INDEX_LABEL: "3"}) == (2, 3, False)


class ProbeTarget(http.server.BaseHTTPRequestHandler):
    """A rank's server: /health answers, and /ready only where `ready_path_served` says so."""

    ready_path_served = True

    def do_GET(self) -> None:
        if self.path == "/health" or (self.path == "/ready" and self.ready_path_served):
            self.send_response(200)
        else:
            self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def rank_server() -> Iterator[type[ProbeTarget]]:
    """A server on a free loopback address at the runtime's port: the address a pod's own IP would be."""
    for last in range(2, 250):
        address = f"127.0.42.{last}"
        try:
            server = http.server.ThreadingHTTPServer((address, HTTP_PORT), ProbeTarget)
        except OSError:
            continue
        break
    else:
        pytest.fail(f"no free loopback address with port {HTTP_PORT}")
    handler = type("Target", (ProbeTarget,), {})
    server.RequestHandlerClass = handler
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    handler.address = address  # type: ignore[attr-defined]
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def run_readiness(rank: str, address: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", RANK_READINESS_SCRIPT],
        env={NODE_RANK_ENV: rank, POD_IP_ENV: address},
        capture_output=True,
        timeout=30,
        check=False,
    )
    return result.returncode


def test_the_readiness_probe_of_a_group_asks_rank_zero_for_ready_and_the_others_for_health(
    rank_server: type[ProbeTarget],
) -> None:
    address = rank_server.address  # type: ignore[attr-defined]
    assert run_readiness("0", address) == 0
    assert run_readiness("1", address) == 0
    rank_server.ready_path_served = False  # a rank > 0 serves /health alone
    assert run_readiness("0", address) != 0, "rank 0 is ready only when /ready says so"
    assert run_readiness("1", address) == 0
    assert run_readiness("1", "127.0.42.255") != 0, "nothing listening: not ready"
