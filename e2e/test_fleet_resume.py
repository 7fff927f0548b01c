"""Streams that survive their replica, through the chart's fleet gateway in front of real `kvfleet serve`
pods: two of three replicas killed with SIGKILL at random moments under 60 long streams (greedy, seeded,
JSON-schema constrained, tool calls) cost no stream, and each answer is the one the healthy fleet gave,
token for token; a scale-down from three replicas to one under streams and plain requests fails none of
them; a rolling update hands the long generations of the replica it stops over to the new one instead of
waiting for them, and fails no request."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from e2e.cluster import KubeAPI, LocalCluster, PodRunner
from e2e.cluster.kube_api import MERGE_PATCH
from e2e.fleet.gateway import metric, serve_through_gateway
from e2e.fleet.kills import ReplicaKiller
from e2e.fleet.manifests import services_path, tiny_service
from e2e.fleet.observe import is_ready, service_pods
from e2e.fleet.streams import ConcurrentStreams, StreamedAnswer, StreamLoad
from e2e.fleet.traffic import ChatLoad, Endpoint, ReadyEndpoints
from e2e.support.waits import wait_for

RESUMES = "kvfleet_gateway_resumes_total"
STREAMS_PER_KIND = 15
# Unconstrained answers run to max_tokens (ignore_eos).
FREE_TOKENS = 220
# Exactly this many digits: with the tiny model's tokenizer a digit, its comma and its space are a token
# each, so an answer is about 250 tokens and always ends within CONSTRAINED_MAX_TOKENS.
DIGITS = 80
CONSTRAINED_MAX_TOKENS = 300
DIGITS_SCHEMA = {
    "type": "object",
    "properties": {
        "digits": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": DIGITS,
            "maxItems": DIGITS,
        }
    },
    "required": ["digits"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "record_digits", "description": "Records digits.", "parameters": DIGITS_SCHEMA},
}
STREAM_TIMEOUT_SECONDS = 300.0


def chaos_requests() -> list[tuple[str, dict[str, Any]]]:
    """(kind, request) of every stream: greedy, seeded temperature-1, JSON-schema constrained and tool-calling
    ones, each with a question of its own."""
    requests = []
    for number in range(STREAMS_PER_KIND):
        messages = [{"role": "user", "content": f"Request {number}: write down a long list of digits."}]
        free = {"messages": messages, "max_tokens": FREE_TOKENS, "extra_body": {"ignore_eos": True}}
        constrained = {"messages": messages, "max_tokens": CONSTRAINED_MAX_TOKENS, "temperature": 1.0}
        schema_format = {"type": "json_schema", "json_schema": {"name": "digits", "schema": DIGITS_SCHEMA}}
        tool_choice = {"type": "function", "function": {"name": "record_digits"}}
        requests += [
            ("greedy", {**free, "temperature": 0.0}),
            ("seeded", {**free, "temperature": 1.0, "seed": number}),
            ("json", {**constrained, "seed": 1000 + number, "response_format": schema_format}),
            ("tool", {**constrained, "seed": 2000 + number, "tools": [TOOL], "tool_choice": tool_choice}),
        ]
    return requests


def check_answer(kind: str, answer: StreamedAnswer) -> None:
    assert answer.complete, answer
    if kind in ("greedy", "seeded"):
        assert len(answer.token_ids) == FREE_TOKENS
    elif kind == "json":
        jsonschema.validate(json.loads(answer.text), DIGITS_SCHEMA)
    else:
        assert answer.finish_reason == "tool_calls", answer
        jsonschema.validate(json.loads(answer.tool_arguments), DIGITS_SCHEMA)


def resumes(gateway: ReadyEndpoints, *labels: str) -> float:
    """The resumes every gateway replica made so far (with these labels)."""
    return sum(metric(endpoint, RESUMES, *labels) for endpoint in gateway.current())


@pytest.fixture(scope="module")
def three_replicas(
    local_cluster: LocalCluster, gateway: ReadyEndpoints, module_namespace: str, tiny_model_dir: Path
) -> str:
    """A service of three replicas behind the gateway, shared by the module's tests; its model's name."""
    # Room for every stream on the one replica that may be left, prompts with a tool's schema included.
    engine = {"maxNumSeqs": 64, "maxModelLen": 1024}
    manifest = tiny_service("chaos", tiny_model_dir, engine=engine, scaling={"replicas": 3})
    manifest["spec"]["model"]["servedName"] = "chaos-model"
    return serve_through_gateway(local_cluster, gateway, module_namespace, manifest)


def scaled(api: KubeAPI, namespace: str, name: str, replicas: int, timeout: float = 120) -> list[str]:
    """Sets the service's replicas and waits until that many pods serve and no other is left; their names."""
    api.patch(
        services_path(namespace, name),
        {"spec": {"scaling": {"replicas": replicas}}},
        content_type=MERGE_PATCH,
    )

    def serving() -> list[str] | None:
        pods = service_pods(api, namespace, name)
        ready = [pod["metadata"]["name"] for pod in pods if _serves(pod)]
        return ready if len(ready) == len(pods) == replicas else None

    return wait_for(f"{replicas} serving replicas of {name}, and no other", serving, timeout, interval=0.25)


def _serves(pod: dict[str, Any]) -> bool:
    """Ready, and not being deleted."""
    conditions = pod["status"].get("conditions") or ()
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return ready and not pod["metadata"].get("deletionTimestamp")


def replica_endpoints(api: KubeAPI, namespace: str, pods: list[str]) -> list[Endpoint]:
    """The runtime endpoints of these pods of the chaos service."""
    addresses = {
        pod["metadata"]["name"]: pod["status"]["podIP"] for pod in service_pods(api, namespace, "chaos")
    }
    return [Endpoint(name, addresses[name]) for name in pods]


def runtime_pid(runner: PodRunner, namespace: str, pod: str) -> int:
    """The PID of a pod's runtime process."""
    pid = runner.process_id(namespace, pod, "runtime")
    assert pid is not None, f"{pod} runs"
    return pid


def test_two_replicas_killed_under_long_streams_cost_no_stream_nor_a_token(
    local_cluster: LocalCluster,
    gateway: ReadyEndpoints,
    module_namespace: str,
    three_replicas: str,
    measurements: Callable[[str], None],
) -> None:
    api, runner, namespace, model = (
        local_cluster.api,
        local_cluster.pod_runner,
        module_namespace,
        three_replicas,
    )
    assert runner is not None
    pods = scaled(api, namespace, "chaos", 3)
    requests = chaos_requests()

    # The answers of the healthy fleet: what each stream must be, token for token, whatever fails.
    started = time.monotonic()
    healthy = ConcurrentStreams(gateway, model, [request for _, request in requests])
    expected = healthy.finish(STREAM_TIMEOUT_SECONDS)
    healthy_seconds = time.monotonic() - started
    for (kind, _), answer in zip(requests, expected, strict=True):
        check_answer(kind, answer)

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Two random moments while the replicas generate, as shares of the tokens the healthy fleet sent: a share
    # of the run's time would miss them, the second run being faster (its prompts are cached, its grammars
    # compiled), and so would a share of what the clients have read, which lags far behind on a loaded
    # machine. For the same reason the shares count from the launch of the streams, not from their first
    # chunks: by the time the slowest client reads its first, the replicas may have generated all. Within the
    # first half: in a full suite's run, with shares drawn up to 0.7, the streams once ended between two
    # reads of the replicas' counters.
    shares = sorted(rng.uniform(0.1, 0.5) for _ in range(2))
    total_tokens = sum(len(answer.token_ids) for answer in expected)
    resumed_before = resumes(gateway)
    endpoints = replica_endpoints(api, namespace, pods)
    pids = {pod: runtime_pid(runner, namespace, pod) for pod in pods}
    with ReplicaKiller(endpoints, pids, [share * total_tokens for share in shares], rng) as killer:
        started = time.monotonic()
        chaos = ConcurrentStreams(gateway, model, [request for _, request in requests])
        answers = chaos.finish(STREAM_TIMEOUT_SECONDS)
        chaos_seconds = time.monotonic() - started
        kills = [
            f"{kill.at - started:.1f}s ({share:.0%} of {total_tokens} tokens due; {kill.generated:.0f} "
            f"generated, {kill.held:.0f} requests held)"
            for share, kill in zip(shares, killer.kills(STREAM_TIMEOUT_SECONDS), strict=True)
        ]
    resumed = resumes(gateway) - resumed_before

    measurements(
        f"{len(requests)} streams, 2 of 3 replicas killed at {kills[0]} and {kills[1]} (seed {seed}): "
        f"{resumed:.0f} resumes; {chaos_seconds:.1f}s against {healthy_seconds:.1f}s healthy"
    )
    assert len(answers) == len(requests)
    for (kind, _), answer, healthy_answer in zip(requests, answers, expected, strict=True):
        check_answer(kind, answer)
        assert answer.token_ids == healthy_answer.token_ids, kind
        assert (answer.text, answer.tool_arguments) == (healthy_answer.text, healthy_answer.tool_arguments)
        assert answer.finish_reason == healthy_answer.finish_reason
    assert resumed >= 1, "the kills cut streams short, which the gateway resumed"


# A scale-down from three replicas to one under both kinds of traffic: streams long enough that the replicas
# stopped hold some past their preStop pause and drain timeout (5 s each), and plain requests.
SCALE_DOWN_STREAMS = 6
SCALE_DOWN_STREAM_TOKENS = 800
SCALE_DOWN_PLAIN_CLIENTS = 3


def test_a_scale_down_under_streams_and_plain_requests_fails_no_request(
    local_cluster: LocalCluster,
    gateway: ReadyEndpoints,
    module_namespace: str,
    three_replicas: str,
    measurements: Callable[[str], None],
) -> None:
    api, namespace, model = local_cluster.api, module_namespace, three_replicas
    scaled(api, namespace, "chaos", 3)
    request = {
        "messages": [{"role": "user", "content": "Tell me about fleets."}],
        "max_tokens": SCALE_DOWN_STREAM_TOKENS,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    handed_back_before = resumes(gateway, 'cause="drain"')
    with (
        StreamLoad(gateway, model, SCALE_DOWN_STREAMS, request, stagger=0.5) as streams,
        ChatLoad(gateway, SCALE_DOWN_PLAIN_CLIENTS, max_tokens=32, model=model) as plain,
    ):
        wait_for("streams and plain answers", lambda: streams.started >= 3 and plain.successes(), 60)
        started = time.monotonic()
        scaled(api, namespace, "chaos", 1, timeout=60)
        scale_down_seconds = time.monotonic() - started
        answered_before = len(plain.successes())
        wait_for("plain answers from the replica left", lambda: len(plain.successes()) > answered_before, 30)
        streams.stop_sending()
    handed_back = resumes(gateway, 'cause="drain"') - handed_back_before
    answers = streams.answers
    measurements(
        f"scale-down 3 -> 1 under {SCALE_DOWN_STREAMS} streams and {SCALE_DOWN_PLAIN_CLIENTS} plain clients: "
        f"{scale_down_seconds:.1f}s until the two replicas were gone, {handed_back:.0f} streams handed back; "
        f"{len(answers)} streams and {len(plain.outcomes)} plain requests, "
        f"{sum(not a.complete for a in answers) + len(plain.failures())} failed"
    )
    assert all(answer.complete for answer in answers), [a.error for a in answers if not a.complete][:3]
    assert not plain.failures(), plain.failures()[:3]
    # One greedy request: each stream, resumed or not, is the same.
    assert len({tuple(answer.token_ids) for answer in answers}) == 1


# Generations as long as the context allows, many at once (each step then takes longer): about 15 s each on
# the tiny model on a 2-core AMD EPYC and 10 s on a faster Xeon, past the preStop pause (5 s) and this
# service's drain timeout, so that a replica stopped under a steady flow of them holds some that would take
# longer than that. With the tiny service's 5 s drain, the Xeon's generations ended within the pause and the
# drain: nothing was left to hand back. With 24 streams started 0.6 s apart, a replica that started in 9 s
# had 15 of them, whose generations ended within the pause and the 1 s drain: 32 streams, all started within
# 10 s, make every step longer.
LONG_GENERATION_TOKENS = 1900
LONG_STREAMS = 32
DRAIN_TIMEOUT_SECONDS = 1
STREAM_STAGGER_SECONDS = 0.3
# How long the rollout may take: the new replica's start, then the old one's preStop pause, drain and exit.
ROLLOUT_TIMEOUT_SECONDS = 180


@dataclass(frozen=True)
class Rollout:
    """Seconds from the spec change until the new replica replaced the old one, and from the old replica's
    deletion until it was gone (its preStop pause, drain and exit)."""

    seconds: float
    old_replica_stop_seconds: float


def roll_out(
    api: KubeAPI,
    namespace: str,
    name: str,
    patch: dict[str, Any],
    on_old_replica_deleted: Callable[[], None] = lambda: None,
) -> Rollout:
    """Patches the InferenceService's spec and waits until the rollout has replaced its replica."""
    (old_pod,) = service_pods(api, namespace, name)
    old_name = old_pod["metadata"]["name"]
    api.patch(services_path(namespace, name), {"spec": patch}, content_type=MERGE_PATCH)
    patched = time.monotonic()
    deleted: list[float] = []

    def rolled_out() -> bool:
        service = api.get(services_path(namespace, name))
        pods = {pod["metadata"]["name"]: pod for pod in service_pods(api, namespace, name)}
        old = pods.get(old_name)
        if not deleted and (old is None or old["metadata"].get("deletionTimestamp")):
            deleted.append(time.monotonic())
            on_old_replica_deleted()
        return is_ready(service) and len(pods) == 1 and old is None

    wait_for("the rollout to finish", rolled_out, ROLLOUT_TIMEOUT_SECONDS, interval=0.25)
    finished = time.monotonic()
    return Rollout(finished - patched, finished - deleted[0])


def test_a_rolling_update_hands_long_generations_over_instead_of_waiting_for_them(
    local_cluster: LocalCluster,
    gateway: ReadyEndpoints,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    engine = {"maxNumSeqs": LONG_STREAMS, "maxModelLen": 2048, "drainTimeoutSeconds": DRAIN_TIMEOUT_SECONDS}
    manifest = tiny_service("rolling", tiny_model_dir, engine=engine)
    manifest["spec"]["model"]["servedName"] = "rolling-model"
    model = serve_through_gateway(local_cluster, gateway, namespace, manifest)
    request = {
        "messages": [{"role": "user", "content": "Tell me everything about fleets."}],
        "max_tokens": LONG_GENERATION_TOKENS,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    # Starts spread over about one generation's time: whenever the replica stops, some have just begun.
    with StreamLoad(gateway, model, LONG_STREAMS, request, stagger=STREAM_STAGGER_SECONDS) as load:
        # The new replica takes longer to start than the staggered starts take.
        wait_for("long generations in flight", lambda: load.started >= 1, 60)
        handed_back_before = resumes(gateway, 'cause="drain"')
        # Once the old replica is stopping, new streams would only prolong the test.
        patch = {"engine": {"maxNumSeqs": LONG_STREAMS + 1}}
        rollout = roll_out(api, namespace, "rolling", patch, on_old_replica_deleted=load.stop_sending)
        handed_back = resumes(gateway, 'cause="drain"') - handed_back_before
    answers = load.answers

    failed = sum(not answer.complete for answer in answers)
    measurements(
        f"rolling update under {LONG_GENERATION_TOKENS}-token generations: {rollout.seconds:.1f}s, the old "
        f"replica stopped in {rollout.old_replica_stop_seconds:.1f}s, {handed_back:.0f} streams resumed "
        f"elsewhere; {len(answers)} streams, {failed} failed"
    )
    assert all(answer.complete for answer in answers), [a.error for a in answers if not a.complete][:3]
    assert handed_back >= 1, "the stopping replica handed its generations back"
    # One greedy request: each answer, resumed or not, is the same.
    assert len({tuple(answer.token_ids) for answer in answers}) == 1
    assert len(answers[0].token_ids) == LONG_GENERATION_TOKENS
