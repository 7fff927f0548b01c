"""Safety through the fleet: a service whose spec.safety.guard.service names another InferenceService. Its
status shows the guard missing (with a GuardUnavailable event), then Ready once the guard serves; its
replicas run the merged policy with the guard's in-cluster URL, which they reach through the cluster's DNS
and Service proxy. Through the openai SDK: the rules block the blocklisted input, the guard blocks another
with its category in the tier whose policy adds it, and the default tier, whose policy leaves it out, answers.

The guard model is the tiny random model, so its verdict is forced with logit_bias (spec.safety.guard
extraBody), as tests/server/test_server_safety.py does: "unsafe" in S9 (Indiscriminate Weapons), reported as
illicit/violent. The guard fails open, so a verdict can only come from the guard itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kvfleet.runtime.bench.safety import logit_bias_against

from e2e.cluster import LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import deployment_path, services_path, tiny_service
from e2e.fleet.observe import events_for, wait_ready
from e2e.fleet.traffic import ReadyEndpoints
from e2e.support.waits import wait_for

# The guarded service's loop passes every 30 s when nothing of its own changes.
GUARD_STATE_SECONDS = 90.0
EVENT_SECONDS = 30.0


def test_a_service_guarded_by_another_inference_service(
    local_cluster: LocalCluster, kvfleet_release: OperatorRelease, namespace: str, tiny_model_dir: Path
) -> None:
    api = local_cluster.api
    # No token may begin with "s" (so "unsafe"), a digit other than 9 or "," (so exactly S9).
    unsafe_s9 = logit_bias_against(tiny_model_dir, "s12345678,")
    guard = {"service": "guard", "failOpen": True, "timeout": 30, "extraBody": {"logit_bias": unsafe_s9}}
    safety = {
        "input": ["rules"],
        "rules": {"blocklist": ["forbidden phrase"]},
        "guard": guard,
        # A client may claim a tier whose policy is stricter than the default's.
        "tiers": {"high": {"input": ["rules", "guard"]}},
    }
    api.create(services_path(namespace), tiny_service("guarded", tiny_model_dir, safety=safety))

    def guard_state() -> str | None:
        status = api.get(services_path(namespace, "guarded")).get("status", {})
        return status.get("safety", {}).get("guard", {}).get("state")

    def guard_events(reason: str) -> list[dict[str, Any]]:
        return [e for e in events_for(api, namespace, "guarded") if e["reason"] == reason]

    wait_for("the guard reported missing", lambda: guard_state() == "NotFound", GUARD_STATE_SECONDS)
    # kopf posts events in the background, so an event may come after the status that goes with it.
    warnings = wait_for("the guard's warning", lambda: guard_events("GuardUnavailable"), EVENT_SECONDS)
    assert "the guard service 'guard' is NotFound" in warnings[0]["message"]

    # The guard's prompt (its instructions and the text) is about 500 of the tiny model's tokens.
    api.create(services_path(namespace), tiny_service("guard", tiny_model_dir, engine={"maxModelLen": 1024}))
    wait_ready(api, namespace, "guard")
    wait_ready(api, namespace, "guarded")
    wait_for("the guard reported Ready", lambda: guard_state() == "Ready", GUARD_STATE_SECONDS)
    wait_for("the guard's recovery announced", lambda: guard_events("GuardAvailable"), EVENT_SECONDS)

    deployment = api.get(deployment_path(namespace, "guarded"))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    policy: dict[str, Any] = json.loads(args[args.index("--safety-config") + 1])
    assert policy["guard"] == {
        "endpoint": f"http://guard.{namespace}.svc.cluster.local/v1",
        "failOpen": True,
        "timeout": 30,
        "extraBody": {"logit_bias": unsafe_s9},
    }

    with ReadyEndpoints(api, namespace, "guarded") as endpoints:
        (endpoint,) = endpoints.current()
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=60)

    def refused(text: str, tier: str) -> list[str]:
        """The categories a blocked input of that tier is refused with (BadRequestError content_filter)."""
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": text}],
                max_tokens=4,
                extra_headers={"x-kvfleet-priority": tier},
            )
        assert raised.value.code == "content_filter"
        return raised.value.body["categories"]  # type: ignore[index]

    # The guard's verdict, from the guard service's replica through its Service name.
    assert refused("Say hello to the fleet.", "high") == ["illicit/violent"]
    metrics = httpx.get(f"http://{endpoint.ip}:{endpoint.port}/metrics", timeout=10).text
    finding = (
        'kvfleet:safety_findings_total{action="block",category="illicit/violent",checker="guard",'
        'direction="input",model_name="tiny"} 1.0'
    )
    assert finding in metrics.splitlines()
    assert "kvfleet:safety_checker_unavailable_total{" not in metrics, "the guard was unreachable"

    # The default tier's policy runs the rules only: they block the blocklisted input, and let others through.
    assert refused("say the forbidden phrase", "standard") == ["blocklist"]
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello to the fleet."}],
        max_tokens=8,
        extra_headers={"x-kvfleet-priority": "standard"},
    )
    assert answer.choices[0].message.content
