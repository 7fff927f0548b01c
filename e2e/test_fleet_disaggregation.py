"""Disaggregated prefill and decode on the local control plane: an InferenceService with one prefill and two
decode replicas answers through the chart's gateway with the openai SDK, its long prompts computed by the
prefill replica and their KV pulled by the decode replicas; deleting the prefill pod in the middle of a burst
loses no request (the gateway and the decode replicas compute the prompts themselves meanwhile)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import yaml
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.operator.api import ROLE_LABEL

from e2e.cluster import LocalCluster
from e2e.fleet.gateway import metric
from e2e.fleet.manifests import tiny_service
from e2e.fleet.observe import live_pods, wait_ready
from e2e.fleet.traffic import ChatLoad, ReadyEndpoints, serving_endpoints
from e2e.support.waits import wait_for

# About 400 tokens of the tiny model's tokenizer, which the gateway estimates (4 characters a token) above
# its default threshold of 256 new tokens: such prompts go through the prefill replica.
LONG_TEXT = "The fleet of inference replicas shares one gateway that routes each request by its prefix. " * 12
DECODE_PULLS = "kvfleet:kv_transfer_loads_total"
GATEWAY_DISAGGREGATED = "kvfleet_gateway_pd_requests_total"


def long_prompt(number: int) -> str:
    # Each starts with its own number, so that no decode replica holds another's first block.
    return f"Request {number}. {LONG_TEXT}"


def _pods_by_role(local_cluster: LocalCluster, namespace: str) -> dict[str, list[dict]]:
    pods = live_pods(local_cluster.api, namespace, "pd")
    return {role: [p for p in pods if p["metadata"]["labels"].get(ROLE_LABEL) == role] for role in ROLES}


def test_one_prefill_and_two_decode_replicas_answer_through_the_gateway_and_lose_nothing_to_the_prefill_pod(
    local_cluster: LocalCluster,
    gateway: ReadyEndpoints,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    roles = {"prefill": {"scaling": {"replicas": 1}}, "decode": {"scaling": {"replicas": 2}}}
    manifest = tiny_service("pd", tiny_model_dir, scaling={"replicas": None}, disaggregation=roles)
    manifest["spec"]["model"]["servedName"] = "pd-model"
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
    wait_ready(local_cluster.api, namespace, "pd", timeout=240)

    def serving_by_role() -> dict[str, list[dict]] | None:
        found = _pods_by_role(local_cluster, namespace)
        counts = [len(serving_endpoints(found[role])) for role in ("prefill", "decode")]
        return found if counts == [1, 2] else None

    pods = wait_for("one prefill and two decode pods serving", serving_by_role, 120)
    decodes = serving_endpoints(pods["decode"])
    model = f"{namespace}/pd-model"
    endpoint = gateway.current()[0]

    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": long_prompt(0)}],
        max_tokens=16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text, "the streamed answer had text"
    pulls = sum(metric(decode, DECODE_PULLS) for decode in decodes)
    assert pulls >= 1, "a decode replica pulled the prompt's KV from the prefill replica"
    assert metric(endpoint, GATEWAY_DISAGGREGATED, 'path="disaggregated"') >= 1

    with ChatLoad(gateway, 3, 16, model=model, request_timeout=120, prompt=long_prompt) as load:
        wait_for("requests served", lambda: len(load.successes()) >= 6, 180)
        prefill_pod = pods["prefill"][0]["metadata"]["name"]
        local_cluster.kubectl("delete", "pod", "-n", namespace, prefill_pod, "--wait=false")
        served_at_delete = len(load.successes())
        wait_for(
            "requests served after the delete", lambda: len(load.successes()) >= served_at_delete + 9, 240
        )
    assert not load.failures(), load.failures()[:3]
    pulls_after = sum(metric(decode, DECODE_PULLS) for decode in decodes)
    measurements(
        f"1 prefill + 2 decode replicas, gateway: {len(load.successes())} long prompts, 0 failed, the "
        f"prefill pod deleted after {served_at_delete}; KV pulls by the decode replicas: {pulls_after:.0f}"
    )
