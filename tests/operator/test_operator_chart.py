"""The Helm chart: CRDs identical to crds/, values every template uses, least-privilege RBAC, and
`helm lint` / `helm template` when a helm binary is available (only those checks skip without one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfleet.operator.kube import PLURALS
from kvfleet.operator.scrape import DEFAULT_MAX_PAGE_BYTES
from kvfleet.operator.tiers import TIERS

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"
CRDS = CHART.parents[1] / "crds"
TEMPLATES = sorted((CHART / "templates").glob("*"))


def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_chart_crds_are_the_repository_crds() -> None:
    chart_crds = {path.name: path.read_bytes() for path in (CHART / "crds").glob("*.yaml")}
    repo_crds = {path.name: path.read_bytes() for path in CRDS.glob("*.yaml")}
    assert chart_crds == repo_crds


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvfleet"
    assert chart["appVersion"] == "0.1.0"


def test_values_name_no_registry_host() -> None:
    config = values()
    for image in (config["image"]["repository"], config["runtime"]["image"]):
        assert "." not in image.split("/")[0], image


def test_priority_classes_match_the_tiers() -> None:
    tiers = values()["priorityClasses"]["tiers"]
    assert set(tiers) == set(TIERS)
    for name, tier in TIERS.items():
        assert tiers[name]["value"] == tier.priority_value
        assert tiers[name]["preemptionPolicy"] == ("PreemptLowerPriority" if tier.preempts else "Never")
        assert tier.priority_class == f"kvfleet-{name}"
    assert "kvfleet-{{ $tier }}" in (CHART / "templates" / "priorityclasses.yaml").read_text()


@pytest.mark.parametrize("template", TEMPLATES, ids=[t.name for t in TEMPLATES])
def test_template_actions_are_balanced(template: Path) -> None:
    text = template.read_text()
    assert text.count("{{") == text.count("}}")
    actions = re.findall(r"{{-?\s*(\w+)", text)
    openers = sum(1 for action in actions if action in ("if", "range", "with", "define"))
    assert openers == actions.count("end")


@pytest.mark.parametrize("template", TEMPLATES, ids=[t.name for t in TEMPLATES])
def test_templates_use_only_defined_values(template: Path) -> None:
    config = values()
    for reference in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()):
        node: Any = config
        for part in reference.split("."):
            assert isinstance(node, dict) and part in node, (
                f"{template.name}: .Values.{reference} is not in values.yaml"
            )
            node = node[part]


def namespaced_rules() -> list[dict[str, Any]]:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    body = helpers.split('{{- define "kvfleet.namespacedRules" -}}')[1].split("{{- end -}}")[0]
    return yaml.safe_load(body)


def verbs_for(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in rules
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_grants_what_the_operator_does_and_no_more() -> None:
    rules = namespaced_rules()
    groups = {
        "Deployment": "apps",
        "Service": "",
        "PodDisruptionBudget": "policy",
        "ServiceMonitor": "monitoring.coreos.com",
    }
    for kind, plural in PLURALS.items():
        # Server-side apply creates through PATCH, which the server authorizes as create for new objects.
        assert {"create", "patch"} <= verbs_for(rules, groups[kind], plural), kind
    assert verbs_for(rules, "apps", "deployments") == {"list", "watch", "create", "patch"}
    assert verbs_for(rules, "", "pods") == {"list", "watch"}
    assert verbs_for(rules, "kvfleet.dev", "inferenceservices/status") == {"patch"}
    assert verbs_for(rules, "", "events") == {"create"}
    everything = {verb for rule in rules for verb in rule["verbs"]}
    assert everything == {"get", "list", "watch", "create", "patch", "update"}, "never delete: owners do that"
    assert verbs_for(rules, "kvfleet.dev", "inferenceservices/finalizers") == {"update"}
    assert [r for r in rules if "update" in r["verbs"]] == [
        {"apiGroups": ["kvfleet.dev"], "resources": ["inferenceservices/finalizers"], "verbs": ["update"]}
    ]
    assert all("*" not in rule["resources"] and "*" not in rule["apiGroups"] for rule in rules)
    assert verbs_for(rules, "", "secrets") == set()


def test_argocd_health_is_the_same_everywhere() -> None:
    lua = (CHART / "files" / "argocd-health.lua").read_text()
    patch = yaml.safe_load((CHART.parents[1] / "examples" / "argocd" / "argocd-cm-health.yaml").read_text())
    assert patch["data"]["resource.customizations.health.kvfleet.dev_InferenceService"] == lua


def run_helm(helm: Path, *args: str) -> str:
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


@pytest.mark.parametrize(
    "settings", [[], ["--set", "watchNamespaces={team-a,team-b}"]], ids=["cluster", "namespaced"]
)
def test_helm_lint(helm: Path, settings: list[str]) -> None:
    run_helm(helm, "lint", "--strict", str(CHART), *settings)


def test_helm_template_cluster_wide(helm: Path) -> None:
    docs = [
        d
        for d in yaml.safe_load_all(
            run_helm(helm, "template", "kv", str(CHART), "-n", "ops", "--include-crds")
        )
        if d
    ]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 3 and kinds.count("PriorityClass") == 4
    assert {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "Deployment", "ServiceAccount"} <= set(
        kinds
    )
    assert "Role" not in kinds and "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "kvfleet/operator:0.1.0"
    assert container["command"] == ["kvfleet", "--log-level", "info", "operator"]
    assert f"--scrape-max-bytes={DEFAULT_MAX_PAGE_BYTES}" in container["args"]
    assert "--peering-name=kvfleet" in container["args"] and not any(
        "--namespace" in a for a in container["args"]
    )
    assert {"name": "KVFLEET_RUNTIME_IMAGE", "value": "kvfleet/runtime:0.1.0"} in container["env"]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kv-kvfleet")
    assert role["rules"][: len(namespaced_rules())] == namespaced_rules()


def test_helm_template_namespaced(helm: Path) -> None:
    out = run_helm(
        helm,
        "template",
        "kv",
        str(CHART),
        "-n",
        "ops",
        "--set",
        "watchNamespaces={team-a,team-b}",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.prometheusRule.labels.release=prometheus",
        "--set",
        "runtime.image=example/runtime:dev",
    )
    docs = [d for d in yaml.safe_load_all(out) if d]
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [c["metadata"]["name"] for c in cluster_roles] == ["kv-kvfleet-crd-reader"]
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert {"name": "KVFLEET_RUNTIME_IMAGE", "value": "example/runtime:dev"} in container["env"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True, "per-service series keep their InferenceService's namespace"
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus", "the label Prometheus selects rules by"
    assert rule["spec"]["groups"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
