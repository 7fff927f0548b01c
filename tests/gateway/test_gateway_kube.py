"""What the Kubernetes discovery makes of InferenceServices and their replicas' pods as the API server
returns them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner
from gateway_harness import pod, service
from kvfleet.gateway.cli import gateway_command
from kvfleet.gateway.discovery import ClientKey, ModelConfig
from kvfleet.gateway.kube import key_secrets, model_configs

DEFAULTS = ModelConfig(name="", endpoints=(), policy="least-request", max_in_flight=16, hold_seconds=30)


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
    assert set(models) == {"default/llama", "default/batchy"}
    llama = models["default/llama"]
    assert (llama.name, llama.namespace, llama.upstream_name) == ("default/llama", "default", "llama")
    assert llama.endpoints == ("http://10.0.0.1:8000", "http://10.0.0.5:8000")
    assert (llama.policy, llama.max_in_flight, llama.default_priority) == ("least-request", 8, 2)
    assert llama.hold_seconds == DEFAULTS.hold_seconds
    batchy = models["default/batchy"]
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
        "default/a": True,
        "default/b": False,
        "default/c": True,
    }


def test_a_service_without_endpoints_is_a_model_at_zero_and_invalid_or_duplicate_ones_are_not_routed() -> (
    None
):
    services = [
        service("b", created="2026-01-01T00:00:00Z", model={"uri": "hf://org/model", "servedName": "same"}),
        service("a", created="2026-01-02T00:00:00Z", model={"uri": "hf://org/model", "servedName": "same"}),
        service("c", created="2026-01-01T00:00:00Z", model={"uri": "hf://org/model", "servedName": "same"}),
        service("broken", model={"uri": "ftp://nowhere"}),
        service("idle"),
    ]
    pods = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2"), pod("c", "10.0.0.3")]
    models = model_configs(services, pods, DEFAULTS)
    assert sorted(models) == ["default/idle", "default/same"]
    assert models["default/same"].endpoints == ("http://10.0.0.2:8000",), (
        "the service created first owns the name, then the first by name: a newer one takes nothing"
    )
    assert models["default/idle"].endpoints == ()


def test_services_of_two_namespaces_serving_one_name_each_keep_their_traffic_and_key() -> None:
    """A service elsewhere that serves the same name (sorting first, created later) takes nothing."""
    services = [
        service("llama", namespace="team-prod", created="2026-01-01T00:00:00Z", **SAME_NAME_KEYED),
        service("x", namespace="aaa", created="2026-02-01T00:00:00Z", **SAME_NAME_KEYED),
        service("open", namespace="aaa", model={"uri": "hf://org/model", "servedName": "open-model"}),
    ]
    pods = [pod("llama", "10.0.1.1", namespace="team-prod"), pod("x", "10.0.2.1", namespace="aaa")]
    keys = {
        ("team-prod", "llama-key"): ClientKey(b"\x01" * 32),
        ("aaa", "llama-key"): ClientKey(b"\x02" * 32),
    }
    models = model_configs(services, pods, DEFAULTS, keys)
    prod, other = models["team-prod/llama-8b"], models["aaa/llama-8b"]
    assert (prod.endpoints, prod.client_key) == (("http://10.0.1.1:8000",), keys[("team-prod", "llama-key")])
    assert (other.endpoints, other.client_key) == (("http://10.0.2.1:8000",), keys[("aaa", "llama-key")])
    assert prod.upstream_name == other.upstream_name == "llama-8b"
    assert prod.forward_authorization, "its replicas check the key again"
    assert not models["aaa/open-model"].forward_authorization, "a service without a key gets none"


SAME_NAME_KEYED: dict[str, Any] = {
    "model": {"uri": "hf://org/model", "servedName": "llama-8b"},
    "engine": {"apiKeySecret": "llama-key"},
}


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
    assert models["default/open"].client_key is None
    assert models["default/keyed"].client_key == digest
    assert models["default/unread"].client_key == ClientKey(None), (
        "a key not read refuses requests, never opens"
    )
    assert models["team/elsewhere"].client_key == ClientKey(None), (
        "Secrets are read in the service's namespace"
    )


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
    assert models["default/big"].endpoints == ("http://10.0.3.1:8000",)
    assert models["default/lws"].endpoints == ("http://10.0.4.1:8000",)


def test_the_gateway_without_cluster_credentials_ends_with_the_reason(tmp_path: Path) -> None:
    empty = tmp_path / "kubeconfig"
    empty.write_text("")
    result = CliRunner().invoke(gateway_command, ["--kubeconfig", str(empty)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "no cluster credentials (in-cluster or kubeconfig)" in result.output
