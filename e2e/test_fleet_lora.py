"""LoRA adapters declared in an InferenceService: served by its running replica through the openai SDK,
a third one added to the spec becomes servable and a removed one answers 404, with the pod never restarted
(the same pod UIDs throughout). The service has an API key, so the operator authenticates its calls with
the key it reads from the service's Secret under the chart's RBAC."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from kvfleet.runtime.lora.make_adapter import make_adapter

from e2e.cluster import LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import services_path, tiny_service
from e2e.fleet.observe import service_pods, wait_ready
from e2e.fleet.traffic import ReadyEndpoints
from e2e.support.waits import condition, wait_for

API_KEY = "lora-fleet-key"
NAME = "lora"


@pytest.fixture(scope="module")
def adapter_uris(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: f"file://{make_adapter(tiny_model_dir, root / name, rank=rank, seed=seed)}"
        for name, rank, seed in (("sql", 8, 1), ("support", 4, 2), ("summary", 16, 3))
    }


def _apply(cluster: LocalCluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def _service(model_dir: Path, uris: dict[str, str], names: list[str]) -> dict[str, Any]:
    adapters = [{"name": name, "uri": uris[name]} for name in names]
    return tiny_service(
        NAME,
        model_dir,
        adapters=adapters,
        engine={"apiKeySecret": "lora-key", "allowRuntimeLoraUpdates": True},
    )


def _adapters_ready(cluster: LocalCluster, namespace: str, names: list[str]) -> dict[str, Any]:
    def served_by_all() -> dict[str, Any] | None:
        service = cluster.api.get(services_path(namespace, NAME))
        ready = condition(service, "AdaptersReady")
        listed = [adapter["name"] for adapter in service.get("status", {}).get("adapters", [])]
        return service if ready and ready["status"] == "True" and listed == names else None

    return wait_for(f"adapters {names} Ready", served_by_all, timeout=90, interval=0.5)


def _complete(client: openai.OpenAI, model: str) -> str:
    completion = client.completions.create(model=model, prompt="The fleet", max_tokens=4, temperature=0.0)
    assert completion.model == model
    return completion.choices[0].text


def test_adapters_follow_the_spec_without_pod_restarts(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    module_namespace: str,
    tiny_model_dir: Path,
    adapter_uris: dict[str, str],
    measurements: Callable[[str], None],
) -> None:
    api, namespace = local_cluster.api, module_namespace
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "lora-key", "labels": {"kvfleet.dev/secret": "true"}},
        "data": {"KVFLEET_API_KEY": base64.b64encode(API_KEY.encode()).decode()},
    }
    _apply(local_cluster, namespace, secret)
    _apply(local_cluster, namespace, _service(tiny_model_dir, adapter_uris, ["sql", "support"]))
    wait_ready(api, namespace, NAME, timeout=120)
    ready = _adapters_ready(local_cluster, namespace, ["sql", "support"])
    assert [a["state"] for a in ready["status"]["adapters"]] == ["Ready", "Ready"]
    uids = {pod["metadata"]["uid"] for pod in service_pods(api, namespace, NAME)}

    with ReadyEndpoints(api, namespace, NAME) as endpoints:
        (endpoint,) = endpoints.current()
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    cards = {model.id: model.model_extra.get("parent") for model in client.models.list().data}
    assert cards == {"tiny": None, "sql": "tiny", "support": "tiny"}
    base = _complete(client, "tiny")
    assert {_complete(client, "sql"), _complete(client, "support")} != {base}, "adapters change the answer"
    with pytest.raises(openai.NotFoundError):
        _complete(client, "summary")

    _apply(local_cluster, namespace, _service(tiny_model_dir, adapter_uris, ["sql", "support", "summary"]))
    _adapters_ready(local_cluster, namespace, ["sql", "support", "summary"])
    _complete(client, "summary")

    _apply(local_cluster, namespace, _service(tiny_model_dir, adapter_uris, ["sql", "summary"]))
    _adapters_ready(local_cluster, namespace, ["sql", "summary"])
    with pytest.raises(openai.NotFoundError):
        _complete(client, "support")
    _complete(client, "sql")

    assert {pod["metadata"]["uid"] for pod in service_pods(api, namespace, NAME)} == uids, "no pod restarted"
    measurements("LoRA adapters: 2 loaded, 1 added, 1 removed in one running replica")
