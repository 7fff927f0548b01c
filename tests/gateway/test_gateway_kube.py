"""What the Kubernetes discovery makes of InferenceServices and their replicas' pods as the API server
returns them."""

from __future__ import annotations

from typing import Any

from kvfleet.gateway.discovery import ClientKey, ModelConfig
from kvfleet.gateway.kube import key_secrets, model_configs

DEFAULTS = ModelConfig(name="", endpoints=(), policy="least-request", max_in_flight=16, hold_seconds=30)


def service(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"uri": "hf://org/model"}, **spec},
    }


def pod(
    service_name: str,
    ip: str | None,
    *,
    ready: bool = True,
    terminating: bool = False,
    port_name: str = "http",
    namespace: str = "default",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": f"{service_name}-{ip}",
        "namespace": namespace,
        "labels": {"kvfleet.dev/inference-service": service_name},
    }
    if terminating:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "runtime", "ports": [{"name": port_name, "containerPort": 8000}]}]},
        "status": status,
    }


def test_ready_endpoints_of_each_service_become_its_models_replicas() -> None:
    services = [
        service("chat", model={"uri": "hf://org/model", "servedName": "llama"}, engine={"maxNumSeqs": 8}),
        service(
            "batchy",
            sla={"tier": "batch"},
            routing={"policy": "prefix-hash", "loadBoundPercent": 150},
            scaling={"minReplicas": 0, "activationTimeoutSeconds": 240},
        ),
    ]
    pods = [
        pod("chat", "10.0.0.1"),
        pod("chat", "10.0.0.2", ready=False),
        pod("chat", "10.0.0.3", terminating=True),
        pod("chat", None),
        pod("chat", "10.0.0.4", port_name="metrics"),
        pod("chat", "10.0.0.5"),
        pod("chat", "10.0.0.6", namespace="elsewhere"),
        pod("batchy", "fd00::5"),
        pod("unrelated", "10.0.0.9"),
    ]
    models = model_configs(services, pods, DEFAULTS)
    assert set(models) == {"llama", "batchy"}
    llama = models["llama"]
    assert llama.endpoints == ("http://10.0.0.1:8000", "http://10.0.0.5:8000")
    assert (llama.policy, llama.max_in_flight, llama.default_priority) == ("least-request", 8, 2)
    assert llama.hold_seconds == DEFAULTS.hold_seconds
    batchy = models["batchy"]
    assert batchy.endpoints == ("http://[fd00::5]:8000",)
    assert batchy.hold_seconds == 240, "a model at zero is held as long as its service allows"
    assert (batchy.policy, batchy.load_bound, batchy.max_in_flight, batchy.default_priority) == (
        "prefix-hash",
        1.5,
        16,
        3,
    )


def test_replicas_preempt_when_their_tier_or_spec_gives_them_the_priority_policy() -> None:
    services = [
        service("by-tier", model={"uri": "hf://org/model", "servedName": "a"}, sla={"tier": "critical"}),
        service("standard", model={"uri": "hf://org/model", "servedName": "b"}),
        service(
            "by-spec",
            model={"uri": "hf://org/model", "servedName": "c"},
            engine={"schedulingPolicy": "priority"},
        ),
    ]
    models = model_configs(services, [], DEFAULTS)
    assert {name: config.replicas_preempt for name, config in models.items()} == {
        "a": True,
        "b": False,
        "c": True,
    }


def test_a_service_without_endpoints_is_a_model_at_zero_and_invalid_or_duplicate_ones_are_not_routed() -> (
    None
):
    services = [
        service("b", model={"uri": "hf://org/model", "servedName": "same"}),
        service("a", model={"uri": "hf://org/model", "servedName": "same"}),
        service("broken", model={"uri": "ftp://nowhere"}),
        service("idle"),
    ]
    pods = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2")]
    models = model_configs(services, pods, DEFAULTS)
    assert sorted(models) == ["idle", "same"]
    assert models["same"].endpoints == ("http://10.0.0.1:8000",), "the first service by name wins"
    assert models["idle"].endpoints == ()


def test_services_with_an_api_key_carry_the_key_read_from_their_secret() -> None:
    services = [
        service("open"),
        service("keyed", engine={"apiKeySecret": "keyed-key"}),
        service("unread", engine={"apiKeySecret": "other-key"}),
        service("elsewhere", namespace="team", engine={"apiKeySecret": "keyed-key"}),
    ]
    assert key_secrets(services) == {
        ("default", "keyed-key"),
        ("default", "other-key"),
        ("team", "keyed-key"),
    }
    digest = ClientKey(b"\x01" * 32)
    models = model_configs(services, [], DEFAULTS, {("default", "keyed-key"): digest})
    assert models["open"].client_key is None
    assert models["keyed"].client_key == digest
    assert models["unread"].client_key == ClientKey(None), "a key not read refuses requests, never opens"
    assert models["elsewhere"].client_key == ClientKey(None), "Secrets are read in the service's namespace"


def test_only_rank_zero_of_a_group_is_routed_to() -> None:
    """A model that spans nodes: every rank of a group is Ready, but only rank 0 serves the API."""
    ranks = [pod("big", f"10.0.3.{rank + 1}") for rank in range(2)]
    for rank, rank_pod in enumerate(ranks):
        rank_pod["metadata"]["labels"] |= {
            "kvfleet.dev/group": "0",
            "apps.kubernetes.io/pod-index": str(rank),
        }
    leader, worker = pod("lws", "10.0.4.1"), pod("lws", "10.0.4.2")
    for index, lws_pod in enumerate([leader, worker]):
        lws_pod["metadata"]["labels"] |= {
            "leaderworkerset.sigs.k8s.io/group-index": "0",
            "leaderworkerset.sigs.k8s.io/worker-index": str(index),
        }
    models = model_configs([service("big"), service("lws")], [*ranks, leader, worker], DEFAULTS)
    assert models["big"].endpoints == ("http://10.0.3.1:8000",)
    assert models["lws"].endpoints == ("http://10.0.4.1:8000",)
