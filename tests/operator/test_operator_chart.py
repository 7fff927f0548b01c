"""The Helm chart: CRDs identical to crds/, values every template uses, least-privilege RBAC, and
`helm lint` / `helm template` when a helm binary is available (only those checks skip without one)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.gateway.cli import gateway_command
from kvfleet.operator.cli import operator_command
from kvfleet.operator.kube import PLURALS
from kvfleet.operator.render import Owner, RenderOptions, render_children
from kvfleet.operator.scrape import DEFAULT_MAX_PAGE_BYTES
from kvfleet.operator.spec import parse_spec
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


@pytest.mark.parametrize(
    ("settings", "prefix"),
    [(["team-a"], "team-a"), (["staging", "--set", "priorityClasses.namePrefix=shared"], "shared")],
    ids=["release", "namePrefix"],
)
def test_priority_classes_are_the_releases_and_the_operator_uses_them(
    helm: Path, settings: list[str], prefix: str
) -> None:
    release, *more = settings
    out = run_helm(helm, "template", release, str(CHART), "-n", "ops", *more)
    docs = [d for d in yaml.safe_load_all(out) if d]
    classes = {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}
    assert classes == {f"{prefix}-{tier}" for tier in TIERS}
    operator = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{release}-kvfleet"
    )
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    options = RenderOptions(priority_class_prefix=env["KVFLEET_PRIORITY_CLASS_PREFIX"])
    for tier in TIERS:
        spec = parse_spec({"model": {"uri": "hf://org/model"}, "sla": {"tier": tier}}, name="m")
        children = render_children(Owner("m", "team", "uid"), spec, 1, options)
        (deployment,) = [child for child in children if child["kind"] == "Deployment"]
        assert deployment["spec"]["template"]["spec"]["priorityClassName"] in classes


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
        "PersistentVolumeClaim": "",
        "StatefulSet": "apps",
        "LeaderWorkerSet": "leaderworkerset.x-k8s.io",
    }
    for kind, plural in PLURALS.items():
        if kind == "Pod":
            continue
        # Server-side apply creates through PATCH, which the server authorizes as create for new objects;
        # get reads the object of the child's name first, which is applied only if the service controls it.
        assert {"get", "create", "patch"} <= verbs_for(rules, groups[kind], plural), kind
    workload = {"get", "list", "watch", "create", "patch", "delete"}
    assert verbs_for(rules, "apps", "deployments") == workload
    assert verbs_for(rules, "apps", "statefulsets") == workload
    assert verbs_for(rules, "leaderworkerset.x-k8s.io", "leaderworkersets") == workload
    # Pods are never created, only deleted together to restart a group.
    assert verbs_for(rules, "", "pods") == {"list", "watch", "deletecollection"}
    assert verbs_for(rules, "kvfleet.dev", "inferenceservices/status") == {"patch"}
    assert verbs_for(rules, "", "events") == {"create"}
    deleting = [rule for rule in rules if {"delete", "deletecollection"} & set(rule["verbs"])]
    assert {resource for rule in deleting for resource in rule["resources"]} == {
        "pods",
        "deployments",
        "statefulsets",
        "leaderworkersets",
    }, "owners delete the other children"
    everything = {verb for rule in rules for verb in rule["verbs"]}
    assert everything == {"get", "list", "watch", "create", "patch", "update", "delete", "deletecollection"}
    assert verbs_for(rules, "kvfleet.dev", "inferenceservices/finalizers") == {"update"}
    assert [r for r in rules if "update" in r["verbs"]] == [
        {"apiGroups": ["kvfleet.dev"], "resources": ["inferenceservices/finalizers"], "verbs": ["update"]}
    ]
    assert all("*" not in rule["resources"] and "*" not in rule["apiGroups"] for rule in rules)
    # Read only, for the API key with which it loads LoRA adapters into a service's replicas.
    assert verbs_for(rules, "", "secrets") == {"get"}


def test_rbac_covers_every_child_of_a_disaggregated_service() -> None:
    """Each role's Deployment is applied as the colocated one is, and deleted when the service turns
    colocated again (and the colocated one when it turns disaggregated)."""
    example = next(
        doc
        for doc in yaml.safe_load_all((CHART.parents[1] / "examples" / "tiny-disaggregated.yaml").read_text())
        if doc and doc["kind"] == "InferenceService"
    )
    spec = parse_spec(example["spec"], name=example["metadata"]["name"])
    assert spec.disaggregation is not None
    owner = Owner(example["metadata"]["name"], "serving", "uid")
    children = render_children(owner, spec, dict.fromkeys(ROLES, 1), RenderOptions(service_monitor=True))
    rules = namespaced_rules()
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        assert {"get", "create", "patch"} <= verbs_for(rules, group, PLURALS[child["kind"]]), child["kind"]
    assert "delete" in verbs_for(rules, "apps", "deployments")


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


def test_the_operator_takes_the_trace_collector_the_chart_names(
    helm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = "http://otel-collector.observability:4318/v1/traces"
    out = run_helm(
        helm,
        "template",
        "kv",
        str(CHART),
        "--set",
        f"runtime.tracing.otlpTracesEndpoint={endpoint}",
        "--set",
        "runtime.tracing.protocol=http/protobuf",
    )
    docs = [d for d in yaml.safe_load_all(out) if d]
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvfleet")
    for variable in operator["spec"]["template"]["spec"]["containers"][0]["env"]:
        if variable["name"].startswith("KVFLEET_OTLP_"):
            monkeypatch.setenv(variable["name"], variable["value"])
    params = operator_command.make_context("operator", []).params
    assert (params["otlp_traces_endpoint"], params["otlp_traces_protocol"]) == (endpoint, "http/protobuf")


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
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvfleet")
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
        "--set",
        "runtime.kernelCache.hostPath=/var/cache/kvfleet-kernels",
    )
    docs = [d for d in yaml.safe_load_all(out) if d]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kv-kvfleet"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [c["metadata"]["name"] for c in cluster_roles] == [
        "kv-kvfleet-crd-reader",
        "kv-kvfleet-namespace-reader",
    ]
    # kopf reads which of its namespaces exist; nothing else cluster-wide.
    assert cluster_roles[1]["rules"] == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}
    ]
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvfleet")
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert {"name": "KVFLEET_RUNTIME_IMAGE", "value": "example/runtime:dev"} in container["env"]
    kernel_cache = {"name": "KVFLEET_KERNEL_CACHE_HOST_PATH", "value": "/var/cache/kvfleet-kernels"}
    assert kernel_cache in container["env"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True, "per-service series keep their InferenceService's namespace"
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus", "the label Prometheus selects rules by"
    assert rule["spec"]["groups"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())


class AdmissionPolicy:
    """A rendered ValidatingAdmissionPolicy evaluated as the API server does: its match conditions, then its
    variables in order, then each validation, whose message expression is evaluated when it fails."""

    def __init__(self, policy: dict[str, Any]) -> None:
        self.spec = policy["spec"]
        self._cel = celpy.Environment()

    def review(self, obj: dict[str, Any], namespace: str, old: dict[str, Any] | None = None) -> list[str]:
        """The messages of the validations the object fails; empty when it is admitted."""
        request = {"operation": "CREATE" if old is None else "UPDATE", "namespace": namespace}
        activation = {
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel(request),
        }
        if not all(self._evaluate(c["expression"], activation) for c in self.spec.get("matchConditions", [])):
            return []
        variables: dict[str, Any] = {}
        for variable in self.spec.get("variables", []):
            variables[variable["name"]] = self._evaluate(
                variable["expression"], {**activation, "variables": celpy.celtypes.MapType(variables)}
            )
        activation["variables"] = celpy.celtypes.MapType(variables)
        return [
            str(self._evaluate(check["messageExpression"], activation))
            for check in self.spec["validations"]
            if not self._evaluate(check["expression"], activation)
        ]

    def _evaluate(self, expression: str, activation: dict[str, Any]) -> Any:
        program = self._cel.program(self._cel.compile(expression), functions={"join": _join})
        return program.evaluate(activation)


def _join(items: celpy.celtypes.ListType, separator: celpy.celtypes.StringType) -> celpy.celtypes.StringType:
    """CEL's strings extension (which Kubernetes enables): list(string).join(separator)."""
    return celpy.celtypes.StringType(separator.join(items))


# The example a platform team starts from: the cases below are its decisions.
POLICY_VALUES = yaml.safe_load((CHART.parents[1] / "examples" / "admission-policy-values.yaml").read_text())


def render_policy(helm: Path, tmp_path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(settings))
    out = run_helm(helm, "template", "kv", str(CHART), "-n", "ops", "-f", str(values))
    return [d for d in yaml.safe_load_all(out) if d and d["kind"].startswith("ValidatingAdmissionPolicy")]


def service_in(crd_validator: Any, **spec: Any) -> dict[str, Any]:
    """An InferenceService as admission sees it: after the schema's defaults."""
    obj = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "m"}}
    defaulted, errors = crd_validator.admit({**obj, "spec": {"model": {"uri": "hf://org/model"}, **spec}})
    assert errors == []
    return defaulted


def test_the_admission_policy_is_on_by_default(helm: Path, tmp_path: Path) -> None:
    kinds = [d["kind"] for d in render_policy(helm, tmp_path, {})]
    assert kinds == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert render_policy(helm, tmp_path, {"admissionPolicy": {"enabled": False}}) == []


def test_the_admission_policy_and_its_binding(helm: Path, tmp_path: Path) -> None:
    policy, binding = render_policy(helm, tmp_path, POLICY_VALUES)
    assert (policy["apiVersion"], binding["apiVersion"]) == ("admissionregistration.k8s.io/v1",) * 2
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"]) == (["kvfleet.dev"], ["inferenceservices"])
    # The allowed values stand in the policy itself, as literals; a trailing "/" of a path is dropped.
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["hostPathPrefixes"] == '["/var/lib/kvfleet/models"]'
    assert variables["tierNamespaces"] == '{"critical":["serving-prod"],"high":["serving-prod","ml-lab"]}'


HOST_PATH_MODEL = {"uri": "file:///var/lib/kvfleet/models/tiny", "hostPath": True}


def env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


# (what, namespace, spec, the message of the refusal or None when admitted)
POLICY_CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("plain service", "team-a", {}, None),
    ("hostPath where allowed", "ml-lab", {"model": HOST_PATH_MODEL}, None),
    (
        "the allowed folder itself",
        "ml-lab",
        {"model": {"uri": "file:///var/lib/kvfleet/models", "hostPath": True}},
        None,
    ),
    ("a path in the image, not the node", "team-a", {"model": {"uri": "file:///etc/passwd"}}, None),
    (
        "hostPath in another namespace",
        "team-a",
        {"model": HOST_PATH_MODEL},
        "spec.model.hostPath: InferenceServices in namespace team-a may not mount a node path; allowed only"
        " in: ml-lab",
    ),
    (
        "hostPath outside the prefixes",
        "ml-lab",
        {"model": {"uri": "file:///etc/kubernetes", "hostPath": True}},
        "spec.model.uri: file:///etc/kubernetes would mount a node path outside the allowed ones"
        " (/var/lib/kvfleet/models)",
    ),
    (
        "a sibling folder that shares the prefix",
        "ml-lab",
        {"model": {"uri": "file:///var/lib/kvfleet/models-private/x", "hostPath": True}},
        "would mount a node path outside the allowed ones",
    ),
    (
        "climbing out of the prefix",
        "ml-lab",
        {"model": {"uri": "file:///var/lib/kvfleet/models/../../../etc", "hostPath": True}},
        "would mount a node path outside the allowed ones",
    ),
    ("critical where allowed", "serving-prod", {"sla": {"tier": "critical"}}, None),
    ("high where allowed", "ml-lab", {"sla": {"tier": "high"}}, None),
    ("an unrestricted tier", "team-a", {"sla": {"tier": "batch"}}, None),
    (
        "critical elsewhere",
        "team-a",
        {"sla": {"tier": "critical"}},
        "spec.sla.tier: the critical tier (PriorityClass kv-critical) may not be claimed in namespace"
        " team-a; allowed only in: serving-prod",
    ),
    ("an allowed image", "team-a", {"engine": {"image": "registry.example.com/kvfleet/runtime:1"}}, None),
    (
        "another registry",
        "team-a",
        {"engine": {"image": "docker.io/someone/miner:latest"}},
        "spec.engine.image: docker.io/someone/miner:latest is not allowed; an image must start with one of:"
        " registry.example.com/kvfleet/",
    ),
    (
        "a look-alike repository",
        "team-a",
        {"engine": {"image": "registry.example.com/kvfleet-other/runtime:1"}},
        "is not allowed",
    ),
    (
        "allowed tolerations",
        "team-a",
        {
            "resources": {
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}, {"key": "dedicated"}]
            }
        },
        None,
    ),
    (
        "a toleration of every taint",
        "team-a",
        {"resources": {"tolerations": [{"operator": "Exists"}]}},
        "spec.resources.tolerations: a toleration without a key (every taint) not allowed; the taint keys"
        " allowed: nvidia.com/gpu, dedicated",
    ),
    (
        "a control-plane toleration",
        "team-a",
        {"resources": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane"}]}},
        "spec.resources.tolerations: key node-role.kubernetes.io/control-plane not allowed",
    ),
    # The example names no env or flag lists: the chart's defaults hold.
    ("tuning variables", "team-a", {"engine": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}}, None),
    (
        "a preloaded library",
        "team-a",
        {"engine": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}, env("LD_PRELOAD", "/tmp/x.so")]}},
        "spec.engine.env: LD_PRELOAD may not be set (the platform denies: LD_*, PYTHON*,",
    ),
    (
        "Python start-up code and another hub",
        "team-a",
        {"engine": {"env": [env("PYTHONPATH", "/tmp"), env("HF_ENDPOINT", "https://hub.invalid")]}},
        "spec.engine.env: PYTHONPATH, HF_ENDPOINT may not be set",
    ),
    (
        "the loader's search path",
        "team-a",
        {"engine": {"env": [env("LD_LIBRARY_PATH", "/tmp")]}},
        "LD_LIBRARY_PATH",
    ),
    (
        "the runtime's own settings",
        "team-a",
        {"engine": {"env": [env("KVFLEET_LOG_LEVEL", "debug")]}},
        "KVFLEET_",
    ),
    (
        "tuning flags",
        "team-a",
        {"engine": {"extraArgs": ["--cpu-kv-cache-space", "0.0625", "--seed=-1", "--device", "cpu"]}},
        None,
    ),
    (
        "a flag replacing the platform's safety policy",
        "team-a",
        {"engine": {"extraArgs": ["--seed", "1", "--safety-config=/tmp/none.json"]}},
        "spec.engine.extraArgs: --safety-config=/tmp/none.json not allowed; the flags allowed:"
        " --max-num-batched-tokens, --num-gpu-blocks-override,",
    ),
    (
        "another model and wider media fetches",
        "team-a",
        {"engine": {"extraArgs": ["--model", "/etc", "--allowed-media-domains", "*"]}},
        "spec.engine.extraArgs: --model, --allowed-media-domains not allowed",
    ),
    ("a negative value", "team-a", {"engine": {"extraArgs": ["--seed", "-1"]}}, None),
    ("a short flag", "team-a", {"engine": {"extraArgs": ["-h"]}}, "spec.engine.extraArgs: -h not allowed"),
    (
        "a flag named after an allowed one",
        "team-a",
        {"engine": {"extraArgs": ["--num-gpu-blocks-override-x"]}},
        "spec.engine.extraArgs: --num-gpu-blocks-override-x not allowed",
    ),
    (
        "tuning flags and tolerations of a role",
        "team-a",
        {
            "disaggregation": {
                "prefill": {
                    "extraArgs": ["--max-num-batched-tokens", "8192"],
                    "resources": {"tolerations": [{"key": "dedicated", "operator": "Exists"}]},
                },
                "decode": {"extraArgs": ["--seed=1"]},
            }
        },
        None,
    ),
    (
        "a role's flag replacing the model",
        "team-a",
        {"disaggregation": {"decode": {"extraArgs": ["--seed", "1", "--model=/etc"]}}},
        "spec.disaggregation.decode.extraArgs: --model=/etc not allowed; the flags allowed:"
        " --max-num-batched-tokens,",
    ),
    (
        "a role's toleration of every taint",
        "team-a",
        {"disaggregation": {"prefill": {"resources": {"tolerations": [{"operator": "Exists"}]}}}},
        "spec.disaggregation.prefill.resources.tolerations: a toleration without a key (every taint) not"
        " allowed; the taint keys allowed: nvidia.com/gpu, dedicated",
    ),
]


@pytest.mark.parametrize(
    ("namespace", "spec", "refusal"),
    [case[1:] for case in POLICY_CASES],
    ids=[case[0] for case in POLICY_CASES],
)
def test_the_admission_policy_decides(
    helm: Path,
    tmp_path: Path,
    crd_validator: Any,
    namespace: str,
    spec: dict[str, Any],
    refusal: str | None,
) -> None:
    policy, _ = render_policy(helm, tmp_path, POLICY_VALUES)
    messages = AdmissionPolicy(policy).review(service_in(crd_validator, **spec), namespace)
    if refusal is None:
        assert messages == []
    else:
        (message,) = messages
        assert refusal in message


def test_the_admission_policy_defaults_refuse_host_paths_images_tiers_tolerations_env_and_flags(
    helm: Path, tmp_path: Path, crd_validator: Any
) -> None:
    policy, _ = render_policy(helm, tmp_path, {})
    review = AdmissionPolicy(policy).review
    # Besides the service's own tolerations and flags, each role's (a disaggregated service's).
    assert len(policy["spec"]["validations"]) == 7 + 2 * 2
    assert review(service_in(crd_validator, model=HOST_PATH_MODEL), "default") == [
        "spec.model.hostPath: InferenceServices in namespace default may not mount a node path; allowed only"
        " in: no namespace",
        "spec.model.uri: file:///var/lib/kvfleet/models/tiny would mount a node path outside the allowed ones"
        " (none)",
    ]
    assert review(service_in(crd_validator, sla={"tier": "critical"}), "default") != []
    assert review(service_in(crd_validator, engine={"image": "x/y:1"}), "default") == [
        "spec.engine.image: x/y:1 is not allowed; leave it out to run the operator's runtime image"
    ]
    everything = {"tolerations": [{"operator": "Exists"}]}
    assert review(service_in(crd_validator, resources=everything), "default") == [
        "spec.resources.tolerations: a toleration without a key (every taint) not allowed; the taint keys"
        " allowed: nvidia.com/gpu"
    ]
    (message,) = review(service_in(crd_validator, engine={"env": [env("LD_PRELOAD", "/x.so")]}), "default")
    assert message.startswith("spec.engine.env: LD_PRELOAD may not be set")
    (message,) = review(
        service_in(crd_validator, engine={"extraArgs": ["--lora-modules", "a=/x"]}), "default"
    )
    assert message.startswith("spec.engine.extraArgs: --lora-modules not allowed")
    # What the examples and the end-to-end services ask for, short of a node path, passes.
    ordinary = service_in(
        crd_validator,
        sla={"tier": "high"},
        engine={"env": [env("OMP_NUM_THREADS", "1")], "extraArgs": ["--cpu-kv-cache-space", "0.0625"]},
        resources={"gpus": 1, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
    )
    assert review(ordinary, "default") == []


def test_each_admission_check_can_be_turned_off(helm: Path, tmp_path: Path, crd_validator: Any) -> None:
    checks = ["imagePrefixes", "tolerationKeys", "deniedEnv", "allowedExtraArgs"]
    policy, _ = render_policy(helm, tmp_path, {"admissionPolicy": dict.fromkeys(checks)})
    assert len(policy["spec"]["validations"]) == 3, "only the node path and tier checks are left"
    loose = service_in(
        crd_validator,
        engine={"image": "x/y:1", "env": [env("LD_PRELOAD", "/x.so")], "extraArgs": ["--model", "/etc"]},
        resources={"tolerations": [{"operator": "Exists"}]},
    )
    assert AdmissionPolicy(policy).review(loose, "default") == []


def test_updates_that_keep_the_spec_are_not_judged(helm: Path, tmp_path: Path, crd_validator: Any) -> None:
    """An object made before the policy keeps working: the operator's finalizer comes and goes."""
    policy, _ = render_policy(helm, tmp_path, POLICY_VALUES)
    old = service_in(crd_validator, sla={"tier": "critical"})
    finalized = {**old, "metadata": {**old["metadata"], "finalizers": ["kvfleet.dev/fleet-loop"]}}
    review = AdmissionPolicy(policy).review
    assert review(finalized, "team-a", old=old) == []
    changed = {**finalized, "spec": {**old["spec"], "engine": {**old["spec"]["engine"], "maxNumSeqs": 8}}}
    assert review(changed, "team-a", old=finalized) != []


# The fleet gateway: rendered, its flags accepted by the real `kvfleet gateway` command, read-only access to
# exactly what its discovery watches.


def render(helm: Path, *settings: str) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", "kv", str(CHART), "-n", "ops", *settings)
    return [d for d in yaml.safe_load_all(out) if d]


def gateway_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["metadata"]["name"] == "kv-kvfleet-gateway"]


ENABLED = ("--set", "gateway.enabled=true")
READ_ONLY_RULES = [
    {"apiGroups": ["kvfleet.dev"], "resources": ["inferenceservices"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
]
KEY_RULES = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]


def key_roles(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """namespace -> the rules of the gateway's Role for API key Secrets there, checked to be bound to it."""
    roles = {
        d["metadata"]["namespace"]: d["rules"]
        for d in objects
        if d["kind"] == "Role" and "-keys" in d["metadata"]["name"]
    }
    bindings = [
        d
        for d in objects
        if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "kv-kvfleet-gateway-keys"
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(roles)
    for binding in bindings:
        assert binding["roleRef"]["name"] == "kv-kvfleet-gateway-keys"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kv-kvfleet-gateway", "namespace": "ops"}
        ]
    return roles


def test_the_gateway_has_two_replicas_a_service_and_read_only_access(helm: Path) -> None:
    objects = [d for d in render(helm, *ENABLED) if d["metadata"]["name"].startswith("kv-kvfleet-gateway")]
    kinds = sorted(d["kind"] for d in objects)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ]
    by_kind = {d["kind"]: d for d in objects}
    deployment = by_kind["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kv-kvfleet-gateway"
    (container,) = pod["containers"]
    assert container["image"] == "kvfleet/operator:0.1.0"
    assert container["command"] == ["kvfleet", "--log-level", "info", "gateway"]
    # The flags are the real command's: click parses them as the container would.
    context = gateway_command.make_context("gateway", list(container["args"]))
    assert context.params["port"] == container["ports"][0]["containerPort"] == 8080
    assert (context.params["policy"], context.params["max_in_flight"]) == ("least-request", 32)
    assert context.params["namespaces"] == ()
    deadlines = ("header_read_timeout", "body_read_timeout", "send_timeout", "upstream_first_byte_timeout")
    assert [context.params[name] for name in deadlines] == [30, 60, 30, 600]
    assert context.params["sse_keep_alive_interval"] == 0, "held streams are silent unless asked for"
    assert context.params["trusted_proxies"] == ""
    selector = deployment["spec"]["selector"]["matchLabels"]
    service = by_kind["Service"]
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    # Serving every namespace: pods and services cluster-wide, and no Secret anywhere.
    assert by_kind["ClusterRole"]["rules"] == READ_ONLY_RULES
    assert by_kind["ClusterRoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "kv-kvfleet-gateway", "namespace": "ops"}
    ]
    operator = next(
        d
        for d in render(helm, *ENABLED)
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvfleet"
    )
    assert operator["spec"]["selector"]["matchLabels"] != selector, (
        "the operator's pods are not the gateway's"
    )


def test_the_gateway_watches_only_the_operators_namespaces_with_roles_there(helm: Path) -> None:
    objects = gateway_objects(
        render(
            helm, *ENABLED, "--set", "watchNamespaces={team-a,team-b}", "--set", "gateway.policy=prefix-hash"
        )
    )
    roles = [d for d in objects if d["kind"] == "Role"]
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert all(role["rules"] == READ_ONLY_RULES for role in roles)
    everything = render(
        helm, *ENABLED, "--set", "watchNamespaces={team-a,team-b}", "--set", "gateway.policy=prefix-hash"
    )
    assert key_roles(everything) == {"team-a": KEY_RULES, "team-b": KEY_RULES}
    assert not [d for d in objects if d["kind"].startswith("Cluster")]
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    params = gateway_command.make_context("gateway", list(args)).params
    assert params["namespaces"] == ("team-a", "team-b") and params["policy"] == "prefix-hash"
    assert params["bare_name_namespace"] is None, "two namespaces: clients qualify every name"


def test_the_gateway_keeps_held_streams_alive_at_the_interval_given(helm: Path) -> None:
    objects = gateway_objects(render(helm, *ENABLED, "--set", "gateway.sseKeepAliveInterval=15"))
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gateway_command.make_context("gateway", list(args)).params["sse_keep_alive_interval"] == 15


def test_the_gateway_takes_bare_names_of_the_namespace_given(helm: Path) -> None:
    objects = gateway_objects(render(helm, *ENABLED, "--set", "gateway.bareNameNamespace=team-prod"))
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gateway_command.make_context("gateway", list(args)).params["bare_name_namespace"] == "team-prod"


def test_the_gateway_sends_its_spans_where_its_tracing_values_say(helm: Path) -> None:
    def container(*values: str) -> dict[str, Any]:
        objects = gateway_objects(render(helm, *ENABLED, *values))
        (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
        return deployment["spec"]["template"]["spec"]["containers"][0]

    def endpoint_flag(container: dict[str, Any]) -> str | None:
        return gateway_command.make_context("gateway", list(container["args"])).params["otlp_traces_endpoint"]

    untraced = container()
    assert "env" not in untraced and endpoint_flag(untraced) is None
    endpoint = "http://otel-collector.observability:4318/v1/traces"
    protocol = "gateway.tracing.protocol=http/protobuf"
    traced = container("--set", f"gateway.tracing.otlpTracesEndpoint={endpoint}", "--set", protocol)
    assert endpoint_flag(traced) == endpoint
    env = {variable["name"]: variable.get("value") for variable in traced["env"]}
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"] == "kv-kvfleet-gateway"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)"
    # Kubernetes expands $(NAME) only from variables defined before it.
    names = list(env)
    assert names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_the_gateway_reads_api_keys_only_in_the_namespaces_it_is_given(helm: Path) -> None:
    """An internet-facing gateway gets no cluster-wide read of Secrets: serving every namespace it reads
    keys only where keyNamespaces says, and gateway.namespaces narrows it below the operator's reach."""
    cluster_wide = render(helm, *ENABLED)
    rules = [rule for d in cluster_wide if d["kind"] in ("ClusterRole", "Role") for rule in d["rules"]]
    assert key_roles(cluster_wide) == {}
    assert not [rule for rule in rules if "secrets" in rule["resources"] and rule not in KEY_RULES]
    assert [
        r
        for d in cluster_wide
        if d["kind"] == "ClusterRole"
        for r in d["rules"]
        if "secrets" in r["resources"]
    ] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}], (
        "the operator's own, for the Secrets InferenceServices name"
    )
    keyed = render(helm, *ENABLED, "--set", "gateway.keyNamespaces={serving-prod}")
    assert key_roles(keyed) == {"serving-prod": KEY_RULES}
    narrowed = gateway_objects(render(helm, *ENABLED, "--set", "gateway.namespaces={serving-prod}"))
    assert not [d for d in narrowed if d["kind"].startswith("Cluster")]
    (role,) = [d for d in narrowed if d["kind"] == "Role"]
    assert (role["metadata"]["namespace"], role["rules"]) == ("serving-prod", READ_ONLY_RULES)
    (deployment,) = [d for d in narrowed if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gateway_command.make_context("gateway", list(args)).params["namespaces"] == ("serving-prod",)
    assert key_roles(render(helm, *ENABLED, "--set", "gateway.namespaces={serving-prod}")) == {
        "serving-prod": KEY_RULES
    }


def test_the_gateway_is_off_by_default(helm: Path) -> None:
    assert gateway_objects(render(helm)) == []


def _value_paths(node: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every value of values.yaml, by its dotted path: down to the objects whose keys the chart fixes (the
    schema lists their properties); a map the user fills (labels, tiers, resources) is one value."""
    if isinstance(node, dict) and "properties" in schema:
        paths = []
        for key, value in node.items():
            assert key in schema["properties"], f"values.schema.json has no {path}{key}"
            paths += _value_paths(value, schema["properties"][key], f"{path}{key}.")
        return paths
    return [path.rstrip(".")]


def test_the_readme_lists_every_value_and_no_other() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths = _value_paths(values(), schema)
    assert len(paths) > 60
    listed = re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", (CHART / "README.md").read_text(), re.MULTILINE)
    assert sorted(set(paths) - set(listed)) == [], "values missing from charts/kvfleet/README.md"
    assert sorted(set(listed) - set(paths)) == [], "the README lists values the chart does not have"


# Each wrong value and where the schema says it is wrong: helm reports them all at once.
WRONG_VALUES = {
    "replicaCount=two": "/replicaCount",
    "gateway.enabled=maybe": "/gateway/enabled",
    "gateway.policy=random": "/gateway/policy",
    "gateway.holdSeconds=soon": "/gateway/holdSeconds",
    "metrics.serviceMonitor.labels.release=1": "/metrics/serviceMonitor/labels/release",
    "watchNamespace={team-a}": "'watchNamespace' not allowed",
    # --set's `{}` is a list of one empty name: a Role in it would land in the release's namespace.
    "gateway.keyNamespaces={}": "/gateway/keyNamespaces/0",
    "watchNamespaces={Team_A}": "/watchNamespaces/0",
}


def test_the_schema_refuses_wrong_values(helm: Path) -> None:
    flags = [flag for setting in WRONG_VALUES for flag in ("--set", setting)]
    result = subprocess.run(
        [str(helm), "template", "kv", str(CHART), *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "values don't meet the specifications" in result.stderr
    for where in WRONG_VALUES.values():
        assert where in result.stderr


def test_helm_template_gateway_monitoring_routes_and_registry(helm: Path) -> None:
    settings = {
        "gateway.enabled": "true",
        "metrics.serviceMonitor.enabled": "true",
        "metrics.serviceMonitor.labels.release": "prometheus",
        "metrics.dashboards.enabled": "true",
        "gateway.httpRoute.enabled": "true",
        "gateway.httpRoute.parentRefs[0].name": "public",
        "gateway.httpRoute.requestTimeout": "3600s",
        "gateway.ingress.enabled": "true",
        "gateway.ingress.host": "llm.example.com",
        "gateway.holdSeconds": "2.5",
        "imageRegistry": "registry.example.com/platform/",
    }
    flags = [flag for key, value in settings.items() for flag in ("--set", f"{key}={value}")]
    docs = [
        d for d in yaml.safe_load_all(run_helm(helm, "template", "kv", str(CHART), "-n", "ops", *flags)) if d
    ]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    (gateway_service,) = [s for s in by_kind["Service"] if s["metadata"]["name"] == "kv-kvfleet-gateway"]
    selectors = {
        monitor["metadata"]["name"]: monitor["spec"]["selector"]["matchLabels"]
        for monitor in by_kind["ServiceMonitor"]
    }
    assert selectors["kv-kvfleet-gateway"] == gateway_service["spec"]["selector"]
    for monitor in by_kind["ServiceMonitor"]:
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (dashboards,) = by_kind["ConfigMap"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = {f"kvfleet-{p.name}": json.loads(p.read_text()) for p in (CHART / "files/dashboards").glob("*")}
    assert {key: json.loads(text) for key, text in dashboards["data"].items()} == shipped
    port = gateway_service["spec"]["ports"][0]
    (route,) = by_kind["HTTPRoute"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": "kv-kvfleet-gateway", "port": port["port"]}]
    assert route["spec"]["parentRefs"] == [{"name": "public"}] and rule["timeouts"] == {"request": "3600s"}
    (ingress,) = by_kind["Ingress"]
    (ingress_rule,) = ingress["spec"]["rules"]
    assert ingress_rule["host"] == "llm.example.com"
    backend = ingress_rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "kv-kvfleet-gateway", "port": {"name": port["name"]}}
    (operator,) = [d for d in by_kind["Deployment"] if d["metadata"]["name"] == "kv-kvfleet"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["KVFLEET_SERVICE_MONITOR_LABELS"]) == {"release": "prometheus"}
    config = values()
    assert env["KVFLEET_RUNTIME_IMAGE"] == f"registry.example.com/platform/{config['runtime']['image']}"
    operator_image = f"registry.example.com/platform/{config['image']['repository']}:0.1.0"
    (gateway,) = [d for d in by_kind["Deployment"] if d["metadata"]["name"] == "kv-kvfleet-gateway"]
    for deployment in (operator, gateway):
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == operator_image
