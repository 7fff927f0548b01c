"""What the Kubernetes discovery makes of InferenceServices and EndpointSlices as the API server returns
them."""

from __future__ import annotations

from typing import Any

from kvfleet.gateway.discovery import ModelConfig
from kvfleet.gateway.kube import model_configs

DEFAULTS = ModelConfig(name="", endpoints=(), policy="least-request", max_in_flight=16, hold_seconds=30)


def service(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"uri": "hf://org/model"}, **spec},
    }


def endpoint_slice(
    service_name: str, *endpoints: tuple[str, dict[str, bool]], **extra: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service_name}-abcde",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": extra.get("address_type", "IPv4"),
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [address], "conditions": conditions} for address, conditions in endpoints
        ],
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
    slices = [
        endpoint_slice(
            "chat",
            ("10.0.0.1", {"ready": True}),
            ("10.0.0.2", {"ready": False}),
            ("10.0.0.3", {"ready": True, "terminating": True}),
            ("10.0.0.4", {}),
        ),
        endpoint_slice("batchy", ("fd00::5", {"ready": True}), address_type="IPv6"),
        endpoint_slice("unrelated", ("10.0.0.9", {"ready": True})),
    ]
    models = model_configs(services, slices, DEFAULTS)
    assert set(models) == {"llama", "batchy"}
    llama = models["llama"]
    assert llama.endpoints == ("http://10.0.0.1:8000", "http://10.0.0.4:8000")
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


def test_a_service_without_endpoints_is_a_model_at_zero_and_invalid_or_duplicate_ones_are_not_routed() -> (
    None
):
    services = [
        service("b", model={"uri": "hf://org/model", "servedName": "same"}),
        service("a", model={"uri": "hf://org/model", "servedName": "same"}),
        service("broken", model={"uri": "ftp://nowhere"}),
        service("idle"),
    ]
    slices = [
        endpoint_slice("a", ("10.0.0.1", {"ready": True})),
        endpoint_slice("b", ("10.0.0.2", {"ready": True})),
    ]
    models = model_configs(services, slices, DEFAULTS)
    assert sorted(models) == ["idle", "same"]
    assert models["same"].endpoints == ("http://10.0.0.1:8000",), "the first service by name wins"
    assert models["idle"].endpoints == ()
