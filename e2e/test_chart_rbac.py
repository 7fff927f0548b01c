"""The chart's RBAC on the real API server, asked with `kubectl auth can-i` as each ServiceAccount: the
operator gets Secrets one by one (never lists them), and the gateway reads no Secret outside the namespaces
it is given."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.fleet.chart import CHART_DIR, OperatorRelease

RBAC_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


def can(local_cluster: LocalCluster, account: str, *ask: str) -> bool:
    result = local_cluster.kubectl("auth", "can-i", *ask, f"--as={account}", check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stderr
    return result.stdout.strip() == "yes"


@pytest.fixture
def gateway_account(local_cluster: LocalCluster, namespace: str, module_namespace: str) -> Iterator[str]:
    """The RBAC of a gateway release in `namespace` (its ServiceAccount, roles and bindings, not its pods)
    serving every namespace and allowed the keys of `module_namespace`; yields its user name."""
    rendered = local_cluster.helm(
        "template",
        "rbac-test",
        str(CHART_DIR),
        "-n",
        namespace,
        "--set=gateway.enabled=true",
        f"--set=gateway.keyNamespaces={{{module_namespace}}}",
        "--show-only=templates/gateway.yaml",
    ).stdout
    access = yaml.safe_dump_all([d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS])
    local_cluster.kubectl("apply", "-f", "-", input=access)
    try:
        yield f"system:serviceaccount:{namespace}:rbac-test-kvfleet-gateway"
    finally:
        local_cluster.kubectl("delete", "-f", "-", input=access)


def test_the_gateway_reads_keys_only_where_it_is_allowed(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,  # its CRDs: InferenceServices are a resource the server knows
    gateway_account: str,
    namespace: str,
    module_namespace: str,
) -> None:
    assert can(local_cluster, gateway_account, "get", "secrets", "-n", module_namespace)
    for elsewhere in (namespace, "kube-system", "default"):
        assert not can(local_cluster, gateway_account, "get", "secrets", "-n", elsewhere), elsewhere
    assert not can(local_cluster, gateway_account, "list", "secrets", "-n", module_namespace)
    # Serving every namespace, it watches pods and InferenceServices everywhere, and writes nothing.
    assert can(local_cluster, gateway_account, "list", "pods", "-A")
    assert can(local_cluster, gateway_account, "watch", "inferenceservices.kvfleet.dev", "-A")
    assert not can(local_cluster, gateway_account, "create", "pods", "-n", module_namespace)


def test_the_operator_gets_secrets_one_by_one(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease
) -> None:
    operator = f"system:serviceaccount:{kvfleet_release.namespace}:{kvfleet_release.release}"
    assert can(local_cluster, operator, "get", "secrets", "-n", "default")
    assert not can(local_cluster, operator, "list", "secrets", "-A")
    assert not can(local_cluster, operator, "watch", "secrets", "-A")
    # Before applying a child, it reads the object of that name.
    for kind in ("deployments", "services", "poddisruptionbudgets", "persistentvolumeclaims"):
        assert can(local_cluster, operator, "get", kind, "-n", "default"), kind
