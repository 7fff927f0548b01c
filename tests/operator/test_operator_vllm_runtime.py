"""spec.engine.runtime vllm: the pods run `vllm serve` from vLLM's image with the flags both runtimes share,
and what only kvfleet's runtime does is refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.kube import model_configs
from kvfleet.operator.api import API_KEY_ENV, API_VERSION, KIND
from kvfleet.operator.render import Owner, RenderOptions, render_children
from kvfleet.operator.render_pod import runtime_args
from kvfleet.operator.safety import SafetyPlatform, check_guardrails_served
from kvfleet.operator.spec import UNSUPPORTED_BY_RUNTIME_REASON, SpecError, parse_spec

OPTIONS = RenderOptions(runtime_image="example/kvfleet-runtime:1", vllm_image="example/vllm:1")
# Every option of `vllm serve` (vLLM 0.32, from its --help) that the operator may render.
VLLM_SERVE_FLAGS = {
    "--served-model-name", "--host", "--port", "--tokenizer", "--chat-template", "--max-num-seqs",
    "--max-model-len", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--scheduling-policy", "--dtype", "--quantization", "--enable-expert-parallel", "--tensor-parallel-size",
    "--pipeline-parallel-size", "--shutdown-timeout",
}  # fmt: skip
EVERY_SHARED_OPTION = {
    "model": {"uri": "file:///m", "tokenizer": "/tok", "chatTemplate": "/chat.jinja", "servedName": "m"},
    "engine": {
        "maxNumSeqs": 8,
        "maxModelLen": 4096,
        "blockSize": 32,
        "enablePrefixCaching": False,
        "schedulingPolicy": "priority",
        "dtype": "bfloat16",
        "quantization": "compressed-tensors",
        "tensorParallelSize": 2,
        "pipelineParallelSize": 2,
        "enableExpertParallel": True,
        "drainTimeoutSeconds": 30,
        "extraArgs": ["--seed", "7"],
    },
    "resources": {"gpus": 4},
}


def service_object(raw: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "svc"}, "spec": raw}


def with_runtime(raw: dict[str, Any], runtime: str) -> dict[str, Any]:
    return {**raw, "engine": {**raw.get("engine", {}), "runtime": runtime}}


def flag_values(args: list[str]) -> dict[str, str | None]:
    """Each flag of a command line with the value after it (None for a switch)."""
    values: dict[str, str | None] = {}
    for index, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[index + 1] if index + 1 < len(args) else None
            values[arg] = None if following is None or following.startswith("--") else following
    return values


def pod_spec(raw: dict[str, Any], options: RenderOptions = OPTIONS) -> dict[str, Any]:
    spec = parse_spec(raw, name="svc")
    children = render_children(Owner("svc", "ns", "uid"), spec, 1, options)
    deployment = next(child for child in children if child["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def test_vllm_serves_the_model_with_the_flags_kvfleet_gets_by_the_same_names() -> None:
    kvfleet = runtime_args(parse_spec(EVERY_SHARED_OPTION, name="svc"))
    vllm = runtime_args(parse_spec(with_runtime(EVERY_SHARED_OPTION, "vllm"), name="svc"))
    model = kvfleet[kvfleet.index("--model") + 1]
    assert vllm[0] == model, "vllm serve takes the model as its first argument"
    assert vllm[-2:] == ["--seed", "7"], "the spec's own arguments come last, to override"
    rendered = flag_values(vllm[1:-2])
    assert set(rendered) <= VLLM_SERVE_FLAGS
    kvfleet_values = flag_values(kvfleet)
    assert rendered["--shutdown-timeout"] == "30"
    assert rendered.items() <= kvfleet_values.items()
    # Every option the spec set reaches vLLM: only kvfleet's own flags are left out.
    assert set(kvfleet_values) - set(rendered) == {
        "--model",
        "--default-priority",
        "--seed",
    }


def test_vllm_pods_run_vllms_image_probed_on_its_health_and_download_with_kvfleets() -> None:
    raw = with_runtime({"model": {"uri": "hf://org/model@v1"}, "resources": {"gpus": 1}}, "vllm")
    pod = pod_spec(raw)
    (container,) = pod["containers"]
    assert container["image"] == OPTIONS.vllm_image
    assert container["command"] == ["vllm", "serve"]
    probes = [
        container[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    ]
    assert probes == ["/health"] * 3
    (download,) = pod["initContainers"]
    assert download["image"] == OPTIONS.runtime_image
    assert download["command"] == ["kvfleet", "download-model"]
    # The model lands where vLLM is told to read it.
    assert container["args"][0] == download["args"][download["args"].index("--dest") + 1]

    named = pod_spec(with_runtime(raw, "vllm") | {"engine": {"runtime": "vllm", "image": "example/vllm:2"}})
    assert named["containers"][0]["image"] == "example/vllm:2"
    assert named["initContainers"][0]["image"] == OPTIONS.runtime_image
    kvfleet = pod_spec({**raw, "engine": {"image": "example/kvfleet-runtime:2"}})
    assert kvfleet["containers"][0]["command"] == ["kvfleet", "serve"]
    assert kvfleet["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {c["image"] for c in [*kvfleet["containers"], *kvfleet["initContainers"]]} == {
        "example/kvfleet-runtime:2"
    }


def test_vllm_reads_the_services_api_key_from_its_own_variable() -> None:
    raw = with_runtime({"model": {"uri": "file:///m"}, "engine": {"apiKeySecret": "svc-key"}}, "vllm")
    env = pod_spec(raw)["containers"][0]["env"]
    assert env[-1] == {
        "name": "VLLM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "svc-key", "key": API_KEY_ENV}},
    }
    assert API_KEY_ENV not in {variable["name"] for variable in env}


REFUSED = {
    "engine.maxWaitingRequests": {"engine": {"maxWaitingRequests": 10}},
    "engine.enableLora": {"engine": {"enableLora": True}},
    "adapters": {"adapters": [{"name": "a", "uri": "pvc://loras/a"}]},
    "batch": {"batch": {"storage": "EmptyDir"}, "scaling": {"maxReplicas": 1}},
    "safety": {"safety": {"level": "high"}},
    "disaggregation": {"disaggregation": {}},
    "scaling.sleepingReplicas": {"scaling": {"sleepingReplicas": 1}},
    "resources.gpusPerNode": {
        "engine": {"tensorParallelSize": 2},
        "resources": {"gpus": 1, "gpusPerNode": 1},
    },
    "routing.policy": {"routing": {"policy": "precise-prefix"}},
}


@pytest.mark.parametrize("field_path", REFUSED)
def test_what_only_kvfleets_runtime_does_is_refused_by_name(field_path: str, crd_validator: Any) -> None:
    """By the operator and, the same, by the API server; both serve it on kvfleet's runtime."""
    raw = {"model": {"uri": "file:///m"}, **REFUSED[field_path]}
    refusal = f"{field_path} is not served with engine.runtime vllm: "
    parse_spec(raw, name="svc")
    _, errors = crd_validator.admit(service_object(raw))
    assert errors == []
    with pytest.raises(SpecError) as refused:
        parse_spec(with_runtime(raw, "vllm"), name="svc")
    assert refused.value.reason == UNSUPPORTED_BY_RUNTIME_REASON
    assert refused.value.message.startswith(f"spec.{refusal}")
    _, errors = crd_validator.admit(service_object(with_runtime(raw, "vllm")))
    assert [error for error in errors if refusal in error], errors


def test_a_vllm_service_of_the_shared_options_is_admitted(crd_validator: Any) -> None:
    _, errors = crd_validator.admit(service_object(with_runtime(EVERY_SHARED_OPTION, "vllm")))
    assert errors == []


def test_a_platform_safety_policy_refuses_vllm_which_has_no_guardrails() -> None:
    platform = SafetyPlatform.parse(json.dumps({"level": "medium", "input": ["rules"]}), "")
    vllm = parse_spec(with_runtime({"model": {"uri": "file:///m"}}, "vllm"), name="svc")
    check_guardrails_served(SafetyPlatform(), vllm)
    check_guardrails_served(platform, parse_spec({"model": {"uri": "file:///m"}}, name="svc"))
    with pytest.raises(SpecError) as refused:
        check_guardrails_served(platform, vllm)
    assert refused.value.reason == UNSUPPORTED_BY_RUNTIME_REASON
    assert "safety.defaults" in refused.value.message


@pytest.mark.parametrize(("runtime", "resumes"), [("kvfleet", True), ("vllm", False)])
def test_the_gateway_resumes_streams_only_on_replicas_that_continue_them(runtime: str, resumes: bool) -> None:
    service = {
        "metadata": {"name": "svc", "namespace": "ns"},
        "spec": with_runtime({"model": {"uri": "file:///m"}}, runtime),
    }
    (config,) = model_configs([service], [], ModelConfig(name="", endpoints=())).values()
    assert config.replicas_resume is resumes
