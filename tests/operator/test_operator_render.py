"""Rendering: golden manifests for every example, and the properties every rendering must have.

Regenerate the golden files after an intended change with KVFLEET_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.kube import model_configs
from kvfleet.gateway.kv_events import EventEndpoints, default_endpoints
from kvfleet.operator.api import (
    API_KEY_ENV,
    API_VERSION,
    HTTP_PORT,
    KIND,
    KV_EVENTS_CONFIG_FLAG,
    KV_TRANSFER_CONFIG_FLAG,
    ROLE_LABEL,
    SERVICE_LABEL,
)
from kvfleet.operator.render import Owner, RenderOptions, Replicas, render_children, service_url
from kvfleet.operator.render_pod import (
    PRESTOP_DELAY_SECONDS,
    READINESS_PATHS,
    TraceExport,
    adapter_source,
    runtime_args,
)
from kvfleet.operator.spec import InferenceServiceSpec, parse_spec

GOLDEN = Path(__file__).parent / "golden"
UID = "6b9c1f5e-0000-4000-8000-000000000001"
OPTIONS = RenderOptions(runtime_image="kvfleet/runtime:0.1.0", service_monitor=True)


def load_service(path: Path) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == KIND)


def render_example(path: Path, replicas: int = 2) -> tuple[InferenceServiceSpec, list[dict[str, Any]]]:
    """A disaggregated example gets `replicas` of each role."""
    doc = load_service(path)
    name = doc["metadata"]["name"]
    spec = parse_spec(doc["spec"], name=name)
    counts: Replicas = replicas if spec.disaggregation is None else dict.fromkeys(ROLES, replicas)
    return spec, render_children(Owner(name, "serving", UID), spec, counts, OPTIONS)


def pod_specs(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod specs of every workload child: the Deployment, group StatefulSets, a LeaderWorkerSet."""
    specs = []
    for child in children:
        if child["kind"] in ("Deployment", "StatefulSet"):
            specs.append(child["spec"]["template"]["spec"])
        elif child["kind"] == "LeaderWorkerSet":
            template = child["spec"]["leaderWorkerTemplate"]
            specs += [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    return specs


def runtime_container(children: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(c for c in children if c["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_golden_manifests(example_path: Path) -> None:
    _, children = render_example(example_path)
    rendered = yaml.safe_dump_all(children, sort_keys=True)
    golden = GOLDEN / f"{example_path.stem}.yaml"
    if os.environ.get("KVFLEET_UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file {golden.name}: run with KVFLEET_UPDATE_GOLDEN=1"
    assert rendered == golden.read_text()


def test_rendering_is_deterministic(example_path: Path) -> None:
    assert render_example(example_path) == render_example(example_path)


def test_every_child_is_owned_and_labelled(example_path: Path) -> None:
    spec, children = render_example(example_path)
    kinds = ["Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"]
    if spec.disaggregation is not None:
        kinds.insert(0, "Deployment")
    if spec.grouped:
        kinds[:1] = ["StatefulSet", "StatefulSet", "Service"]
    if spec.batch is not None and spec.batch.storage == "PersistentVolumeClaim":
        kinds.insert(0, "PersistentVolumeClaim")
    assert [c["kind"] for c in children] == kinds
    name = load_service(example_path)["metadata"]["name"]
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": name,
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "serving"
        assert child["metadata"]["labels"][SERVICE_LABEL] == name


def test_deployment_never_drops_capacity_and_drains(example_path: Path) -> None:
    spec, children = render_example(example_path)
    deployment = next((c for c in children if c["kind"] == "Deployment"), None)
    if spec.grouped:
        # Groups roll one at a time through the operator (test_operator_controller.py).
        assert deployment is None
    elif spec.batch is not None:
        # The Batch API's single replica: its store has one writer, even during a rollout.
        assert deployment is not None and deployment["spec"]["strategy"] == {"type": "Recreate"}
    else:
        assert (
            deployment is not None and deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        )
    for pod in pod_specs(children):
        container = pod["containers"][0]
        drain = spec.engine.drain_timeout_seconds
        # vLLM's flag, which both runtimes take.
        assert container["args"][container["args"].index("--shutdown-timeout") + 1] == str(drain)
        assert pod["terminationGracePeriodSeconds"] > drain + PRESTOP_DELAY_SECONDS
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == PRESTOP_DELAY_SECONDS
        if not spec.grouped:
            readiness = container["readinessProbe"]
            assert readiness["httpGet"]["path"] == READINESS_PATHS[spec.engine.runtime]
            # A replica takes traffic within a second of being ready (a request held at zero waits on it).
            assert readiness.get("initialDelaySeconds", 0) == 0 and readiness["periodSeconds"] == 1
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= spec.engine.startup_timeout_seconds
        # No readiness probe runs before the startup probe passes: it must not hold a loaded replica back.
        assert startup["periodSeconds"] == 1


def test_pods_run_locked_down(example_path: Path) -> None:
    _, children = render_example(example_path)
    for pod in pod_specs(children):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["capabilities"] == {"drop": ["ALL"]}


def test_no_registry_host_in_any_image(example_path: Path) -> None:
    _, children = render_example(example_path)
    images = re.findall(r"image: (\S+)", yaml.safe_dump_all(children))
    assert images
    for image in images:
        first = image.split("/")[0]
        assert "." not in first and ":" not in first, image


def test_tiny_cpu_example() -> None:
    _, children = render_example(GOLDEN.parent.parent.parent / "examples" / "tiny-cpu.yaml")
    container = runtime_container(children)
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert container["command"] == ["kvfleet", "serve"]
    assert container["args"][:10] == [
        "--model",
        "/var/lib/kvfleet/models/tiny-llama",
        "--served-model-name",
        "tiny",
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--max-num-seqs",
        "16",
    ]
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert "tolerations" not in pod
    (model_volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert model_volume["hostPath"] == {"path": "/var/lib/kvfleet/models/tiny-llama", "type": "Directory"}
    assert "--tensor-parallel-size" not in container["args"]


def test_gpu_example_requests_tensor_parallel_gpus() -> None:
    _, children = render_example(GOLDEN.parent.parent.parent / "examples" / "llama-8b-tp2.yaml")
    container = runtime_container(children)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "kvfleet-high"
    (init,) = pod["initContainers"]
    assert init["command"] == ["kvfleet", "download-model"]
    assert init["args"] == ["meta-llama/Llama-3.1-8B-Instruct", "--dest", container["args"][1]]
    secret = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert secret["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    api_key = next(e for e in container["env"] if e["name"] == "KVFLEET_API_KEY")
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "llama-8b-api-key", "key": "KVFLEET_API_KEY"}
    assert all("secretKeyRef" not in str(e) for e in init["env"] if e["name"] != "HF_TOKEN"), (
        "each container gets only the secret it uses"
    )


def test_batch_example_is_preemptible_fcfs_on_a_claim() -> None:
    _, children = render_example(GOLDEN.parent.parent.parent / "examples" / "batch-tier.yaml")
    container = runtime_container(children)
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "kvfleet-batch"
    args = container["args"]
    assert args[args.index("--scheduling-policy") + 1] == "fcfs"
    assert args[args.index("--default-priority") + 1] == "batch"
    assert args[args.index("--model") + 1] == "/mnt/models/qwen3/Qwen3-8B"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "model-store", "readOnly": True}


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ({"enablePrefixCaching": False}, ["--no-enable-prefix-caching"]),
        ({"enablePrefixCaching": True}, ["--enable-prefix-caching"]),
        ({"schedulingPolicy": "priority"}, ["--scheduling-policy", "priority"]),
        ({"blockSize": 32}, ["--block-size", "32"]),
        ({"dtype": "float16"}, ["--dtype", "float16"]),
        ({"quantization": "compressed-tensors"}, ["--quantization", "compressed-tensors"]),
        ({"enableExpertParallel": True, "tensorParallelSize": 2}, ["--enable-expert-parallel"]),
        ({"maxModelLen": 4096}, ["--max-model-len", "4096"]),
        ({"maxWaitingRequests": 100}, ["--max-waiting-requests", "100"]),
        ({"extraArgs": ["--seed", "7"]}, ["--seed", "7"]),
    ],
)
def test_engine_options_become_runtime_flags(engine: dict[str, Any], expected: list[str]) -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}, "engine": engine}, name="svc")
    args = runtime_args(spec)
    start = next(i for i in range(len(args)) if args[i : i + len(expected)] == expected)
    assert args[start : start + len(expected)] == expected


def test_tokenizer_and_chat_template_overrides() -> None:
    model = {"uri": "file:///m", "tokenizer": "/tok", "chatTemplate": "/templates/chat.jinja"}
    args = runtime_args(parse_spec({"model": model}, name="svc"))
    assert args[args.index("--tokenizer") + 1] == "/tok"
    assert args[args.index("--chat-template") + 1] == "/templates/chat.jinja"
    assert args[args.index("--served-model-name") + 1] == "svc"


def test_tier_sets_default_priority_and_policy() -> None:
    for tier, policy in [
        ("critical", "priority"),
        ("high", "priority"),
        ("standard", "fcfs"),
        ("batch", "fcfs"),
    ]:
        args = runtime_args(parse_spec({"model": {"uri": "file:///m"}, "sla": {"tier": tier}}, name="s"))
        assert args[args.index("--default-priority") + 1] == tier
        assert args[args.index("--scheduling-policy") + 1] == policy


def test_replicas_and_service_monitor_toggle() -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}}, name="svc")
    owner = Owner("svc", "ns", UID)
    children = render_children(owner, spec, 3, RenderOptions())
    assert [c["kind"] for c in children] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert children[0]["spec"]["replicas"] == 3
    assert children[0]["spec"]["template"]["spec"]["containers"][0]["image"] == "kvfleet/runtime:0.1.0"
    custom = render_children(owner, spec, 1, RenderOptions(runtime_image="example/runtime:dev"))
    assert custom[0]["spec"]["template"]["spec"]["containers"][0]["image"] == "example/runtime:dev"
    assert service_url(owner, RenderOptions()) == "http://svc.ns.svc.cluster.local"


def test_the_service_monitor_carries_the_platforms_labels_and_selects_the_replicas() -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}}, name="svc")
    labels = {"release": "prometheus", SERVICE_LABEL: "another"}
    options = RenderOptions(service_monitor=True, service_monitor_labels=labels)
    children = render_children(Owner("svc", "ns", UID), spec, 1, options)
    (monitor,) = [child for child in children if child["kind"] == "ServiceMonitor"]
    (service,) = [child for child in children if child["kind"] == "Service"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # The platform's labels never take the service's own: the monitor must still select its Service.
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"][SERVICE_LABEL] == "svc"


def test_the_api_key_secret_comes_after_every_user_variable() -> None:
    """The schema and parse_spec refuse a user KVFLEET_API_KEY; should one reach the renderer all the same,
    the Secret's entry is the later one, which is the value a container gets."""
    spec = parse_spec(
        {
            "model": {"uri": "file:///m"},
            "engine": {"apiKeySecret": "svc-key", "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
        },
        name="svc",
    )
    smuggled = dataclasses.replace(
        spec.engine, env=((API_KEY_ENV, "chosen-by-the-spec"), *spec.engine.env, ("TZ", "UTC"))
    )
    for engine in (spec.engine, smuggled):
        env = runtime_container(
            render_children(Owner("svc", "ns", UID), dataclasses.replace(spec, engine=engine), 1, OPTIONS)
        )["env"]
        assert env[-1] == {
            "name": API_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": "svc-key", "key": API_KEY_ENV}},
        }


def test_batch_api_store_is_a_claim_mounted_and_passed_to_the_runtime() -> None:
    _, children = render_example(GOLDEN.parent.parent.parent / "examples" / "batch-api.yaml", replicas=1)
    claim = children[0]
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["metadata"]["name"] == "batch-api-demo-batch"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}}
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "batch"]
    assert volume == {"name": "batch", "persistentVolumeClaim": {"claimName": "batch-api-demo-batch"}}
    container = runtime_container(children)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "batch"]
    args = container["args"]
    assert args[args.index("--batch-store") + 1] == mount["mountPath"]
    assert args[args.index("--max-batch-file-bytes") + 1] == "209715200"


@pytest.mark.parametrize(
    ("batch", "volume", "claim"),
    [
        ({}, {"persistentVolumeClaim": {"claimName": "svc-batch"}}, {"storage": "10Gi"}),
        (
            {"storageClassName": "fast", "size": "1Ti"},
            {"persistentVolumeClaim": {"claimName": "svc-batch"}},
            {"storage": "1Ti", "storageClassName": "fast"},
        ),
        ({"storage": "EmptyDir"}, {"emptyDir": {}}, None),
        ({"storage": "EmptyDir", "size": "5Gi"}, {"emptyDir": {"sizeLimit": "5Gi"}}, None),
    ],
)
def test_batch_store_volume(
    batch: dict[str, Any], volume: dict[str, Any], claim: dict[str, str] | None
) -> None:
    raw = {"model": {"uri": "file:///m"}, "scaling": {"replicas": 1}, "batch": batch}
    spec = parse_spec(raw, name="svc")
    children = render_children(Owner("svc", "serving", UID), spec, 1, OPTIONS)
    claims = [c for c in children if c["kind"] == "PersistentVolumeClaim"]
    if claim is None:
        assert claims == []
    else:
        (rendered,) = claims
        assert rendered["spec"]["resources"]["requests"]["storage"] == claim["storage"]
        assert rendered["spec"].get("storageClassName") == claim.get("storageClassName")
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert {"name": "batch", **volume} in pod["volumes"]
    assert "--max-batch-file-bytes" not in runtime_args(spec)


def test_services_without_batch_get_no_batch_api() -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}}, name="svc")
    assert spec.batch is None
    assert "--batch-store" not in runtime_args(spec)


LORA_ADAPTERS = [
    {"name": "a", "uri": "pvc://loras/team/a"},
    {"name": "b", "uri": "hf://org/b@v1"},
    {"name": "c", "uri": "pvc://loras/c"},
]


def test_lora_adapters_are_flags_and_clients_cannot_load_any_unless_the_spec_allows_runtime_updates() -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}, "adapters": LORA_ADAPTERS}, name="svc")
    args = runtime_args(spec)
    assert "--allow-runtime-lora-updates" not in args
    modules = [args[i + 1] for i, arg in enumerate(args) if arg == "--lora-modules"]
    assert modules == [
        "a=/mnt/adapter-claims/loras/team/a",
        "b=hf://org/b@v1",
        "c=/mnt/adapter-claims/loras/c",
    ]


def test_lora_with_runtime_updates_has_no_adapter_flags_and_claims_are_mounted_read_only() -> None:
    raw = {
        "model": {"uri": "file:///m"},
        "engine": {"allowRuntimeLoraUpdates": True},
        "adapters": LORA_ADAPTERS,
    }
    spec = parse_spec(raw, name="svc")
    container = runtime_container(render_children(Owner("svc", "ns", UID), spec, 1, OPTIONS))
    args = container["args"]
    assert args[args.index("--enable-lora") : args.index("--enable-lora") + 3] == [
        "--enable-lora",
        "--lora-download-dir",
        "/mnt/adapters",
    ]
    assert "--allow-runtime-lora-updates" in args
    assert not any("lora-modules" in arg for arg in args), "adapters are loaded at run time, not flags"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/mnt/adapter-claims/loras"]["readOnly"] is True
    assert "/mnt/adapters" in mounts
    assert "HF_HUB_OFFLINE" not in {e["name"] for e in container["env"]}, "the replica fetches hf:// adapters"
    assert [adapter_source(a) for a in spec.adapters] == [
        "/mnt/adapter-claims/loras/team/a",
        "hf://org/b@v1",
        "/mnt/adapter-claims/loras/c",
    ]


def test_enable_lora_keeps_the_template_when_adapters_come_and_go() -> None:
    def template(adapters: list[dict[str, str]]) -> dict[str, Any]:
        engine = {"enableLora": True, "allowRuntimeLoraUpdates": True}
        raw = {"model": {"uri": "file:///m"}, "engine": engine, "adapters": adapters}
        children = render_children(Owner("svc", "ns", UID), parse_spec(raw, name="svc"), 1, OPTIONS)
        return next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]

    assert template([]) == template([{"name": "x", "uri": "file:///loras/x"}])


def disaggregated_children(
    prefill: int = 1, decode: int = 2, **sections: Any
) -> tuple[InferenceServiceSpec, list[dict[str, Any]]]:
    raw = {
        "model": {"uri": "file:///m"},
        "engine": {"extraArgs": ["--seed", "7"]},
        "resources": {"cpu": "2"},
        "disaggregation": {
            "decode": {"resources": {"gpus": 1, "memory": "16Gi"}, "extraArgs": ["--max-num-seqs", "64"]}
        },
        **sections,
    }
    spec = parse_spec(raw, name="svc")
    return spec, render_children(
        Owner("svc", "ns", UID), spec, {"prefill": prefill, "decode": decode}, OPTIONS
    )


def kv_transfer_config(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    (at,) = [index for index, arg in enumerate(args) if arg == KV_TRANSFER_CONFIG_FLAG]
    return json.loads(args[at + 1])


def test_each_role_is_a_deployment_of_its_own_pods() -> None:
    _, children = disaggregated_children()
    deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
    assert set(deployments) == {"svc-prefill", "svc-decode"}, "no colocated Deployment"
    for role in ROLES:
        deployment = deployments[f"svc-{role}"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector == {SERVICE_LABEL: "svc", ROLE_LABEL: role}
        assert pod_labels[ROLE_LABEL] == role and pod_labels[SERVICE_LABEL] == "svc"
        assert selector.items() <= pod_labels.items()
        other = "decode" if role == "prefill" else "prefill"
        assert (
            not selector.items()
            <= deployments[f"svc-{other}"]["spec"]["template"]["metadata"]["labels"].items()
        ), "neither Deployment's selector takes the other's pods"
        assert deployment["metadata"]["labels"][ROLE_LABEL] == role
    assert (
        deployments["svc-prefill"]["spec"]["replicas"],
        deployments["svc-decode"]["spec"]["replicas"],
    ) == (1, 2)


def test_role_pods_pass_their_side_of_the_kv_connector_and_expose_its_port() -> None:
    _, children = disaggregated_children()
    for deployment in (c for c in children if c["kind"] == "Deployment"):
        role = deployment["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        config = kv_transfer_config(container)
        assert config["kv_connector"] == "TcpConnector"
        assert config["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert config["kv_port"] == 14579
        # The kubelet expands $(NAME) from the container's own variables: this one is the pod's address.
        variable = re.fullmatch(r"\$\((\w+)\)", config["kv_ip"])
        assert variable is not None, config["kv_ip"]
        (entry,) = [e for e in container["env"] if e["name"] == variable.group(1)]
        assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        ports = {port["name"]: port for port in container["ports"]}
        assert ports["kv-transfer"] == {
            "name": "kv-transfer",
            "containerPort": config["kv_port"],
            "protocol": "TCP",
        }
        assert container["command"] == ["kvfleet", "serve"]


def test_each_role_runs_its_own_resources_and_arguments_after_the_services() -> None:
    _, children = disaggregated_children()
    containers = {
        c["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]: c["spec"]["template"]["spec"]["containers"][
            0
        ]
        for c in children
        if c["kind"] == "Deployment"
    }
    prefill, decode = containers["prefill"], containers["decode"]
    assert prefill["resources"] == {
        "requests": {"cpu": "2", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert decode["resources"] == {
        "requests": {"memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"},
    }
    assert prefill["args"][-2:] == ["--seed", "7"]
    assert decode["args"][-4:] == ["--seed", "7", "--max-num-seqs", "64"]
    for container in (prefill, decode):
        assert container["args"].index(KV_TRANSFER_CONFIG_FLAG) < container["args"].index("--seed")


def test_the_service_sends_requests_to_the_decode_role_and_the_budget_spans_both() -> None:
    _, children = disaggregated_children()
    service = next(c for c in children if c["kind"] == "Service")
    assert service["spec"]["selector"] == {SERVICE_LABEL: "svc", ROLE_LABEL: "decode"}
    budget = next(c for c in children if c["kind"] == "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == {SERVICE_LABEL: "svc"}


def test_colocated_pods_have_no_role_and_no_kv_connector() -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}}, name="svc")
    children = render_children(Owner("svc", "ns", UID), spec, 1, OPTIONS)
    container = runtime_container(children)
    assert KV_TRANSFER_CONFIG_FLAG not in container["args"]
    assert ROLE_LABEL not in children[0]["spec"]["template"]["metadata"]["labels"]
    assert [port["name"] for port in container["ports"]] == ["http"]
    assert ROLE_LABEL not in next(c for c in children if c["kind"] == "Service")["spec"]["selector"]


def test_precise_prefix_replicas_publish_kv_events_where_the_gateway_subscribes() -> None:
    raw = {"model": {"uri": "file:///m"}, "routing": {"policy": "precise-prefix"}}
    spec = parse_spec(raw, name="svc")
    children = render_children(Owner("svc", "ns", UID), spec, 1, OPTIONS)
    container = runtime_container(children)
    args = container["args"]
    config = json.loads(args[args.index(KV_EVENTS_CONFIG_FLAG) + 1])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    # vLLM's keys; the replica binds every interface of its pod (`*`).
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports['kv-events']}",
        "replay_endpoint": f"tcp://*:{ports['kv-replay']}",
    }
    # The gateway finds the pod through discovery, and subscribes at its address with the default ports.
    template = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]
    pod = {
        "metadata": {"namespace": "ns", "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
        "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    service = {"metadata": {"name": "svc", "namespace": "ns"}, "spec": raw}
    (routed,) = model_configs([service], [pod], ModelConfig(name="", endpoints=())).values()
    assert routed.policy == "precise-prefix"
    (replica,) = routed.endpoints
    assert default_endpoints(replica) == EventEndpoints(
        f"tcp://10.1.2.3:{ports['kv-events']}", f"tcp://10.1.2.3:{ports['kv-replay']}"
    )
    other = parse_spec({"model": {"uri": "file:///m"}, "routing": {"policy": "cache-aware"}}, name="svc")
    container = runtime_container(render_children(Owner("svc", "ns", UID), other, 1, OPTIONS))
    assert KV_EVENTS_CONFIG_FLAG not in container["args"]
    assert [port["name"] for port in container["ports"]] == ["http"]


def test_a_node_kernel_cache_is_a_host_folder_where_each_image_builds_apart() -> None:
    spec = parse_spec({"model": {"uri": "file:///m"}}, name="svc")
    owner = Owner("svc", "ns", UID)

    def pod(options: RenderOptions) -> dict[str, Any]:
        return pod_specs(render_children(owner, spec, 1, options))[0]

    assert "kernel-cache" not in str(pod(RenderOptions())) and "TORCH_EXTENSIONS_DIR" not in str(pod(OPTIONS))
    folders = []
    for image in ("kvfleet/runtime:0.1.0", "registry.example/kvfleet/runtime@sha256:0123abcd"):
        shared = pod(RenderOptions(runtime_image=image, kernel_cache_host_path="/var/cache/kernels"))
        (volume,) = [v for v in shared["volumes"] if v["name"] == "kernel-cache"]
        assert volume["hostPath"] == {"path": "/var/cache/kernels", "type": "DirectoryOrCreate"}
        container = shared["containers"][0]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kernel-cache"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TORCH_EXTENSIONS_DIR"].startswith(mount["mountPath"] + "/")
        assert "/" not in env["TORCH_EXTENSIONS_DIR"].removeprefix(mount["mountPath"] + "/")
        assert env["TRITON_CACHE_DIR"] == env["TORCH_EXTENSIONS_DIR"] + "/triton"
        folders.append(env["TORCH_EXTENSIONS_DIR"])
    assert len(set(folders)) == 2


@pytest.mark.parametrize("runtime", ["kvfleet", "vllm"])
def test_traced_pods_send_their_spans_where_the_platform_collects_them_named_after_their_service(
    runtime: str,
) -> None:
    spec = parse_spec(
        {"model": {"uri": "file:///m"}, "engine": {"runtime": runtime, "extraArgs": ["--seed", "7"]}},
        name="chat",
    )
    owner = Owner("chat", "team-a", UID)
    traces = TraceExport("http://otel-collector.observability:4318/v1/traces", "http/protobuf")
    container = runtime_container(render_children(owner, spec, 1, RenderOptions(traces=traces)))
    args = container["args"]
    # Before the service's own flags, which may name another collector where the admission policy allows.
    flag = args.index("--otlp-traces-endpoint")
    assert args[flag + 1 : flag + 4] == [traces.endpoint, "--seed", "7"]
    env = container["env"]
    values = {entry["name"]: entry.get("value") for entry in env}
    assert values["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert values["OTEL_SERVICE_NAME"] == "chat"
    # The kubelet expands $(NAME) only from variables listed before the one that names it.
    names = [entry["name"] for entry in env]
    attributes = values["OTEL_RESOURCE_ATTRIBUTES"]
    downward = {"KVFLEET_POD_NAMESPACE": "metadata.namespace", "KVFLEET_POD_NAME": "metadata.name"}
    for name, path in downward.items():
        assert env[names.index(name)]["valueFrom"] == {"fieldRef": {"fieldPath": path}}
        assert f"$({name})" in attributes and names.index(name) < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert attributes.startswith("k8s.namespace.name=$(KVFLEET_POD_NAMESPACE),k8s.pod.name=")
    untraced = runtime_container(render_children(owner, spec, 1, RenderOptions()))
    assert "--otlp-traces-endpoint" not in untraced["args"] and "OTEL_" not in json.dumps(untraced["env"])
