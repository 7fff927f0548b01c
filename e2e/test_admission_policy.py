"""The chart's ValidatingAdmissionPolicy on the real API server. The installed release's policy (on by
default) refuses environment variables that load code, runtime flags outside its allowlist and tolerations
of every taint. A second one, rendered from other values and applied beside it, refuses a forbidden node
path, tier or image with its message, while the same asks in the namespace allowed them are accepted; it is
removed afterwards."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.fleet.chart import CHART_DIR, OperatorRelease
from e2e.fleet.manifests import fake_gpu_service
from e2e.support.waits import wait_for

MODEL_FOLDER = "/var/lib/kvfleet/models"


def kubectl_apply(
    cluster: LocalCluster, namespace: str, manifest: dict[str, Any], *options: str
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "apply", "-n", namespace, *options, "-f", "-", input=yaml.safe_dump(manifest), check=False
    )


def critical_service(name: str) -> dict[str, Any]:
    """Suspended (no pod): only admission matters here."""
    return fake_gpu_service(name, sla={"tier": "critical"}, scaling={"replicas": 0})


def host_path_service(name: str, path: str) -> dict[str, Any]:
    return fake_gpu_service(name, model={"uri": f"file://{path}", "hostPath": True}, scaling={"replicas": 0})


@pytest.fixture
def policy(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str, tmp_path: Path
) -> Iterator[str]:
    """The chart's policy and binding, letting only `namespace` mount node paths (under MODEL_FOLDER) and
    claim the critical tier, and only images from registry.invalid/; yields the policy's name."""
    served = local_cluster.api.get("/apis/admissionregistration.k8s.io/v1")["resources"]
    assert {"validatingadmissionpolicies", "validatingadmissionpolicybindings"} <= {r["name"] for r in served}
    values = tmp_path / "policy.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "admissionPolicy": {
                    "enabled": True,
                    "hostPath": {"namespaces": [namespace], "pathPrefixes": [MODEL_FOLDER]},
                    "tierNamespaces": {"critical": [namespace]},
                    "imagePrefixes": ["registry.invalid/"],
                }
            }
        )
    )
    # Another release name than the installed one's, so that its policy stands beside the release's.
    template = ("template", "policy-test", str(CHART_DIR), "-f", str(values))
    rendered = local_cluster.helm(*template, "--show-only", "templates/admissionpolicy.yaml").stdout
    name = next(d for d in yaml.safe_load_all(rendered) if d)["metadata"]["name"]
    local_cluster.kubectl("apply", "-f", "-", input=rendered)
    probe = critical_service("policy-probe")
    try:
        # The API server picks new policies up from a watch: refusals start within moments.
        wait_for(
            "the policy to refuse",
            lambda: kubectl_apply(local_cluster, "default", probe, "--dry-run=server").returncode != 0,
        )
        yield name
    finally:
        local_cluster.kubectl("delete", "-f", "-", input=rendered)
        wait_for(
            "the policy to be gone",
            lambda: kubectl_apply(local_cluster, "default", probe, "--dry-run=server").returncode == 0,
        )


def test_the_policy_refuses_what_the_values_forbid(
    local_cluster: LocalCluster, policy: str, namespace: str, module_namespace: str
) -> None:
    allowed, other = namespace, module_namespace
    forbidden = [
        (
            host_path_service("node-path", f"{MODEL_FOLDER}/tiny"),
            f"spec.model.hostPath: InferenceServices in namespace {other} may not mount a node path; allowed"
            f" only in: {allowed}",
        ),
        (
            critical_service("critical"),
            "spec.sla.tier: the critical tier (PriorityClass policy-test-critical) may not be claimed in"
            f" namespace {other}; allowed only in: {allowed}",
        ),
        (
            fake_gpu_service("miner", engine={"image": "docker.io/someone/miner:1"}),
            "spec.engine.image: docker.io/someone/miner:1 is not allowed; an image must start with one of:"
            " registry.invalid/",
        ),
    ]
    for manifest, message in forbidden:
        result = kubectl_apply(local_cluster, other, manifest)
        assert result.returncode != 0, f"{manifest['metadata']['name']} was accepted: {result.stdout}"
        assert f"ValidatingAdmissionPolicy '{policy}'" in result.stderr, result.stderr
        assert message in result.stderr, result.stderr
    outside = kubectl_apply(local_cluster, allowed, host_path_service("etc", "/etc/kubernetes"))
    assert outside.returncode != 0 and "would mount a node path outside the allowed ones" in outside.stderr
    for manifest in (host_path_service("node-path", f"{MODEL_FOLDER}/tiny"), critical_service("critical")):
        result = kubectl_apply(local_cluster, allowed, manifest)
        assert result.returncode == 0, result.stderr
    # Elsewhere, what the policy leaves alone is accepted: a tier it does not name, an image it allows.
    plain = fake_gpu_service("plain", sla={"tier": "high"}, scaling={"replicas": 0})
    result = kubectl_apply(local_cluster, other, plain)
    assert result.returncode == 0, result.stderr


# The installed release's policy: the chart's defaults, less the node path, tier and image checks
# (LOCAL_CLUSTER_POLICY).
RELEASE_POLICY = "kvfleet-inferenceservice-limits"


def test_the_release_refuses_code_loading_env_unlisted_flags_and_every_taint(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str
) -> None:
    forbidden = [
        (
            fake_gpu_service("preload", engine={"env": [{"name": "LD_PRELOAD", "value": "/tmp/hook.so"}]}),
            "spec.engine.env: LD_PRELOAD may not be set (the platform denies: LD_*, PYTHON*,",
        ),
        (
            fake_gpu_service(
                "hub", engine={"env": [{"name": "HF_ENDPOINT", "value": "https://hub.invalid"}]}
            ),
            "spec.engine.env: HF_ENDPOINT may not be set",
        ),
        (
            fake_gpu_service("unsafe", engine={"extraArgs": ["--safety-config", "{}"]}),
            "spec.engine.extraArgs: --safety-config not allowed; the flags allowed: --max-num-batched-tokens",
        ),
        (
            fake_gpu_service("anywhere", resources={"tolerations": [{"operator": "Exists"}]}),
            "spec.resources.tolerations: a toleration without a key (every taint) not allowed",
        ),
    ]
    for manifest, message in forbidden:
        result = kubectl_apply(local_cluster, namespace, manifest, "--dry-run=server")
        assert result.returncode != 0, f"{manifest['metadata']['name']} was accepted: {result.stdout}"
        assert f"ValidatingAdmissionPolicy '{RELEASE_POLICY}'" in result.stderr, result.stderr
        assert message in result.stderr, result.stderr
    tuned = fake_gpu_service(
        "tuned",
        engine={
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
            "extraArgs": ["--num-gpu-blocks-override", "64"],
        },
        resources={"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
    )
    result = kubectl_apply(local_cluster, namespace, tuned, "--dry-run=server")
    assert result.returncode == 0, result.stderr
