"""The InferenceService CRD as the real API server applies it: every example is accepted (with the schema's
defaults filled in), and invalid resources are rejected with a message that names the field and the rule.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from e2e.cluster import ApiError, LocalCluster
from e2e.fleet.chart import EXAMPLES_DIR, OperatorRelease
from e2e.fleet.manifests import KIND, fake_gpu_service, inference_service, services_path
from e2e.fleet.observe import service_pods, wait_ready

VALID_SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/model"}}


def example_services() -> list[tuple[str, dict[str, Any]]]:
    """(file name, manifest) of every InferenceService in examples/ (other kinds, e.g. Argo CD's, skipped)."""
    found = []
    for path in sorted(EXAMPLES_DIR.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == KIND:
                found.append((str(path.relative_to(EXAMPLES_DIR)), document))
    return found


def test_examples_hold_inference_services() -> None:
    assert {name for name, _ in example_services()} >= {
        "tiny-cpu.yaml",
        "llama-8b-tp2.yaml",
        "batch-tier.yaml",
    }


@pytest.mark.parametrize(("file_name", "manifest"), example_services(), ids=lambda value: str(value)[:40])
def test_the_server_accepts_every_example(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    module_namespace: str,
    file_name: str,
    manifest: dict[str, Any],
) -> None:
    result = local_cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        module_namespace,
        "-o",
        "json",
        "-f",
        "-",
        input=yaml.safe_dump(manifest),
    )
    stored = json.loads(result.stdout)
    assert stored["spec"]["model"] == {**{"hostPath": False}, **manifest["spec"]["model"]}
    # The schema's defaults are filled in where the example leaves them out.
    scaling = stored["spec"]["scaling"]
    assert scaling["metricsIntervalSeconds"] == 2
    assert scaling["panicWindowSeconds"] == manifest["spec"]["scaling"].get("panicWindowSeconds", 6)
    assert stored["spec"]["engine"]["imagePullPolicy"] == "IfNotPresent"


# How schema and CEL failures start ({name}: the resource's name).
IS_INVALID = 'The InferenceService "{name}" is invalid: '
# (what is wrong, spec, fragments the server's message must contain)
INVALID: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "min-over-max",
        {**VALID_SPEC, "scaling": {"minReplicas": 3, "maxReplicas": 2}},
        [IS_INVALID, "spec.scaling", "scaling.minReplicas must not exceed scaling.maxReplicas"],
    ),
    (
        "unknown-tier",
        {**VALID_SPEC, "sla": {"tier": "premium"}},
        [IS_INVALID, "spec.sla.tier", 'Unsupported value: "premium"', '"critical"', '"batch"'],
    ),
    (
        "string-for-integer",
        {**VALID_SPEC, "scaling": {"maxReplicas": "four"}},
        [IS_INVALID, "spec.scaling.maxReplicas", "must be of type integer"],
    ),
    (
        "boolean-for-integer",
        {**VALID_SPEC, "engine": {"maxNumSeqs": True}},
        [IS_INVALID, "spec.engine.maxNumSeqs", "must be of type integer"],
    ),
    (
        "number-for-boolean",
        {**VALID_SPEC, "engine": {"enablePrefixCaching": 1}},
        [IS_INVALID, "spec.engine.enablePrefixCaching", "must be of type boolean"],
    ),
    ("no-model", {"engine": {"dtype": "float32"}}, [IS_INVALID, "spec.model", "Required value"]),
    (
        "unsupported-uri",
        {"model": {"uri": "s3://bucket/weights"}},
        [IS_INVALID, "spec.model.uri", "model.uri must be hf://<org>/<name>[@<revision>]"],
    ),
    (
        "host-path-for-hub-model",
        {"model": {"uri": "hf://acme/model", "hostPath": True}},
        [IS_INVALID, "spec.model", "model.hostPath applies only to file:/// URIs"],
    ),
    (
        "fewer-gpus-than-tensor-parallel",
        {**VALID_SPEC, "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 1}},
        [IS_INVALID, "resources.gpus must be at least engine.tensorParallelSize × pipelineParallelSize"],
    ),
    (
        "ranks-not-a-multiple-of-gpus-per-node",
        {**VALID_SPEC, "engine": {"tensorParallelSize": 3}, "resources": {"gpusPerNode": 2}},
        [
            IS_INVALID,
            "engine.tensorParallelSize × pipelineParallelSize must be a multiple of resources.gpusPerNode",
        ],
    ),
    (
        "group-pod-gpus-other-than-gpus-per-node",
        {
            **VALID_SPEC,
            "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
            "resources": {"gpusPerNode": 2, "gpus": 4},
        },
        [IS_INVALID, "resources.gpus must equal resources.gpusPerNode when the model spans nodes"],
    ),
    (
        "panic-window-over-stable-window",
        {**VALID_SPEC, "scaling": {"stableWindowSeconds": 10, "panicWindowSeconds": 20}},
        [IS_INVALID, "scaling.panicWindowSeconds must not exceed scaling.stableWindowSeconds"],
    ),
    (
        "negative-min-replicas",
        {**VALID_SPEC, "scaling": {"minReplicas": -1}},
        [IS_INVALID, "spec.scaling.minReplicas", "should be greater than or equal to 0"],
    ),
    (
        "api-key-in-env",
        {**VALID_SPEC, "engine": {"apiKeySecret": "key", "env": [{"name": "KVFLEET_API_KEY", "value": "x"}]}},
        [IS_INVALID, "spec.engine.env[0]", "engine.env must not set KVFLEET_API_KEY"],
    ),
    (
        "api-key-flag",
        {**VALID_SPEC, "engine": {"apiKeySecret": "key", "extraArgs": ["--api-key", "x"]}},
        [IS_INVALID, "spec.engine.extraArgs[0]", "engine.extraArgs must not pass --api-key"],
    ),
    (
        "safety-guard-service-and-endpoint",
        {**VALID_SPEC, "safety": {"guard": {"service": "guard", "endpoint": "self"}}},
        [IS_INVALID, "spec.safety.guard", "give one of service and endpoint"],
    ),
    (
        "safety-unknown-tier",
        {**VALID_SPEC, "safety": {"tiers": {"gold": {"action": "flag"}}}},
        [IS_INVALID, "spec.safety.tiers", "tiers are critical, high, standard and batch"],
    ),
    (
        "safety-unknown-level",
        {**VALID_SPEC, "safety": {"level": "extreme"}},
        [IS_INVALID, "spec.safety.level", "Unsupported value"],
    ),
    (
        # kubectl asks the server for strict field validation: a typo is an error, not silently pruned.
        "unknown-field",
        {**VALID_SPEC, "scaling": {"maxReplica": 3}},
        ["strict decoding error", 'unknown field "spec.scaling.maxReplica"'],
    ),
]


@pytest.mark.parametrize(("case", "spec", "fragments"), INVALID, ids=[case for case, _, _ in INVALID])
def test_the_server_rejects_invalid_resources(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    module_namespace: str,
    case: str,
    spec: dict[str, Any],
    fragments: list[str],
) -> None:
    manifest = inference_service(case, spec)
    result = local_cluster.kubectl(
        "apply", "-n", module_namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0, f"{case} was accepted: {result.stdout}"
    message = result.stderr
    for fragment in (fragment.format(name=case) for fragment in fragments):
        assert fragment in message, f"{fragment!r} not in the server's message:\n{message}"
    assert local_cluster.api.get(services_path(module_namespace))["items"] == []


def test_rejection_is_a_422_with_the_causes(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, module_namespace: str
) -> None:
    """What API clients (the kubernetes library, Argo CD) get: HTTP 422 Invalid, one cause per field."""
    manifest = inference_service(
        "two-faults", {**VALID_SPEC, "sla": {"tier": "gold"}, "scaling": {"minReplicas": -1}}
    )
    with pytest.raises(ApiError) as raised:
        local_cluster.api.create(services_path(module_namespace), manifest)
    assert raised.value.status == 422 and raised.value.reason == "Invalid"
    message = str(raised.value)
    assert "spec.sla.tier" in message and "spec.scaling.minReplicas" in message


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("a" * 64, "metadata.name must be at most 63 characters"),
        ("llama.8b", "metadata.name must be a DNS-1035 label"),
        ("8b-llama", "metadata.name must be a DNS-1035 label"),
    ],
    ids=["too-long", "dotted", "leading-digit"],
)
def test_the_server_rejects_names_the_children_cannot_take(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    module_namespace: str,
    name: str,
    fragment: str,
) -> None:
    """Each is a valid name for a custom resource, but not for the Service the operator would make."""
    manifest = inference_service(name, VALID_SPEC)
    result = local_cluster.kubectl(
        "apply", "-n", module_namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0, f"{name} was accepted: {result.stdout}"
    assert IS_INVALID.format(name=name) in result.stderr and fragment in result.stderr, result.stderr


# 63 characters: the longest name a Service (a DNS-1035 label) and a label value can take.
LONGEST_NAME = "llama-3-1-8b-instruct-" + "x" * 40 + "9"


def test_the_longest_name_gets_valid_children(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    """The operator applies every child under the longest allowed name, and the Deployment's ReplicaSet and
    pod (whose names the controllers derive from it) come up Ready."""
    assert len(LONGEST_NAME) == 63
    api = local_cluster.api
    local_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(fake_gpu_service(LONGEST_NAME))
    )
    wait_ready(api, namespace, LONGEST_NAME)
    assert (
        api.get(f"/api/v1/namespaces/{namespace}/services/{LONGEST_NAME}")["metadata"]["name"] == LONGEST_NAME
    )
    budget = api.get(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{LONGEST_NAME}")
    assert budget["metadata"]["name"] == LONGEST_NAME
    (pod,) = service_pods(api, namespace, LONGEST_NAME)
    assert pod["status"]["phase"] == "Running"
