"""The fleet gateway measured on the local control plane, with real `kvfleet serve` pods:

    python -m e2e.bench_gateway                    # both scenarios below
    python -m e2e.bench_gateway --scenario policies --requests 120 --rate 1.5 --json result.json

Routing policies (`--scenario policies`, 3 replicas of the `small` model per policy):

One multi-tenant workload, the same for every policy: each tenant's requests share a long system prompt and
differ in the question; they arrive as a seeded Poisson process and stream, so time to first token is read
as the client sees it. Each policy gets a fresh service (its replicas start with empty caches), whose KV
cache holds the prefixes of about a third of the tenants per replica, so where a request lands decides
whether its prefix is cached. One replica alone, with as much cache as the whole fleet, is the reference for
the hit rate.
The fleet's prefix-cache hit rate is read from the replicas' own counters.

Overload by tier (`--scenario overload`, one replica of the `small` model): requests of mixed tiers (10%
critical, 30% standard, 60% batch) arrive faster than the replica serves them, once straight to the replica,
as behind a plain Service (the replica, of a `standard` service, runs them first come, first served, batch
requests only when nothing else waits, and holds every request it is sent), and once through the gateway,
whose queue is ordered by tier and bounded (`gateway.maxQueue`): time to first token per tier, and the
requests shed (429) per tier. With 1,500 requests, p99 is not a single critical request.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import openai
import yaml
from kvfleet.contract.tiers import PRIORITY_HEADER
from kvfleet.operator.api import qualified_name

from e2e.cluster import ClusterConfig, LocalCluster
from e2e.fleet.chart import OPERATOR_NAMESPACE, install_chart
from e2e.fleet.gateway import gateway_endpoints
from e2e.fleet.manifests import services_path, tiny_service
from e2e.fleet.observe import service_pods, wait_ready
from e2e.fleet.traffic import serving_endpoints
from e2e.support.waits import wait_for

POLICIES = ("round-robin", "least-request", "prefix-hash", "cache-aware")
TIER_MIX = (("critical", 0.1), ("standard", 0.3), ("batch", 0.6))
OVERLOAD_MAX_QUEUE = 24
NAMESPACE = "bench-gateway"
# Each tenant's system prompt: a few hundred tokens of its own text.
SYSTEM_SENTENCES = 24


@dataclass(frozen=True)
class TierResult:
    mode: str
    tier: str
    requests: int
    shed: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    replicas: int
    requests: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float


def percentiles_ms(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values) or [float("nan")]
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return round(statistics.median(ordered) * 1000, 1), round(p99 * 1000, 1)


def stream_ttft(
    client: openai.OpenAI, model: str, messages: list[dict[str, str]], **options: object
) -> float:
    """Seconds until the first token of a streamed chat completion."""
    sent = time.monotonic()
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **options)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.monotonic() - sent
    return first if first is not None else time.monotonic() - sent


def replay(schedule: list[tuple[float, tuple[Any, ...]]], send: Callable[..., None]) -> None:
    """Calls send(*arguments) in a thread of its own at each (second, arguments) of the schedule, open loop,
    and waits for them all."""
    started = time.monotonic()
    threads = []
    for arrival, arguments in schedule:
        time.sleep(max(0.0, started + arrival - time.monotonic()))
        thread = threading.Thread(target=send, args=arguments, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)


def system_prompt(tenant: int, rng: random.Random) -> str:
    words = ["fleet", "replica", "cache", "tenant", "prompt", "token", "policy", "queue", "model", "route"]
    sentences = [
        f"Tenant {tenant} rule {index}: " + " ".join(rng.choice(words) for _ in range(12)) + "."
        for index in range(SYSTEM_SENTENCES)
    ]
    return " ".join(sentences)


def workload(tenants: int, requests: int, rate: float, seed: int) -> list[tuple[float, str, str]]:
    """(arrival second, system prompt, question) per request, the same for every policy."""
    rng = random.Random(seed)
    prompts = [system_prompt(tenant, rng) for tenant in range(tenants)]
    arrivals, now = [], 0.0
    for number in range(requests):
        now += rng.expovariate(rate)
        arrivals.append((now, rng.choice(prompts), f"Question {number}: which rule applies?"))
    return arrivals


def hit_rate(cluster: LocalCluster, name: str) -> float:
    hits = queries = 0.0
    for endpoint in serving_endpoints(service_pods(cluster.api, NAMESPACE, name)):
        with urllib.request.urlopen(f"http://{endpoint.ip}:{endpoint.port}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("kvfleet:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("kvfleet:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits / queries if queries else 0.0


def run_policy(
    cluster: LocalCluster,
    gateway_url: str,
    model_dir: Path,
    policy: str,
    replicas: int,
    kv_blocks: int,
    load_bound_percent: int,
    requests: list[tuple[float, str, str]],
) -> PolicyResult:
    name = f"bench-{policy}-{replicas}"
    manifest = tiny_service(
        name,
        model_dir,
        engine={
            "maxNumSeqs": 8,
            "maxModelLen": 2048,
            "extraArgs": ["--num-gpu-blocks-override", str(kv_blocks)],
        },
        scaling={"replicas": replicas},
        routing={"policy": policy, "loadBoundPercent": load_bound_percent},
        resources={"memory": "4Gi"},
    )
    manifest["spec"]["model"]["servedName"] = name
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(manifest))
    wait_ready(cluster.api, NAMESPACE, name, timeout=300)
    wait_for(
        f"{replicas} ready replicas",
        lambda: len(serving_endpoints(service_pods(cluster.api, NAMESPACE, name))) == replicas,
        120,
    )
    client = openai.OpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=300)
    model = qualified_name(NAMESPACE, name)
    # The gateway learns the service's replicas through its watch: wait until it routes to the model.
    wait_for("the gateway to know the model", lambda: model in {m.id for m in client.models.list().data}, 60)
    ttfts: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def send(system: str, question: str) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        try:
            ttft = stream_ttft(client, model, messages, max_tokens=4, extra_body={"ignore_eos": True})
            with lock:
                ttfts.append(ttft)
        except openai.APIError as error:
            with lock:
                failures.append(str(error))

    replay([(arrival, (system, question)) for arrival, system, question in requests], send)
    rate = hit_rate(cluster, name)
    cluster.api.delete(services_path(NAMESPACE, name))
    wait_for("the service's pods gone", lambda: not service_pods(cluster.api, NAMESPACE, name), 120)
    return PolicyResult(
        policy, replicas, len(requests), len(failures), *percentiles_ms(ttfts), round(rate, 3)
    )


def run_overload(
    cluster: LocalCluster, gateway_url: str, model_dir: Path, requests: int, rate: float, seed: int
) -> list[TierResult]:
    name = "bench-overload"
    manifest = tiny_service(name, model_dir, engine={"maxNumSeqs": 4}, scaling={"replicas": 1})
    manifest["spec"]["model"]["servedName"] = name
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(manifest))
    wait_ready(cluster.api, NAMESPACE, name, timeout=300)
    (replica,) = serving_endpoints(service_pods(cluster.api, NAMESPACE, name))
    rng = random.Random(seed)
    tiers = [tier for tier, _ in TIER_MIX]
    plan, now = [], 0.0
    for _ in range(requests):
        now += rng.expovariate(rate)
        plan.append((now, rng.choices(tiers, weights=[share for _, share in TIER_MIX])[0]))
    results = []
    for mode, base_url in (("direct to the replica", replica.base_url), ("through the gateway", gateway_url)):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        results += _overload_run(client, name, mode, plan)
    cluster.api.delete(services_path(NAMESPACE, name))
    wait_for("the service's pods gone", lambda: not service_pods(cluster.api, NAMESPACE, name), 120)
    return results


def _overload_run(
    client: openai.OpenAI, model: str, mode: str, plan: list[tuple[float, str]]
) -> list[TierResult]:
    tiers = [tier for tier, _ in TIER_MIX]
    outcomes: dict[str, list[float]] = {tier: [] for tier in tiers}
    shed = dict.fromkeys(tiers, 0)
    failed = dict.fromkeys(tiers, 0)
    lock = threading.Lock()

    def send(tier: str, number: int) -> None:
        messages = [{"role": "user", "content": f"Request {number}: tell me about fleets."}]
        try:
            ttft = stream_ttft(
                client,
                model,
                messages,
                max_tokens=32,
                extra_body={"ignore_eos": True},
                extra_headers={PRIORITY_HEADER: tier},
            )
            with lock:
                outcomes[tier].append(ttft)
        except openai.RateLimitError:
            with lock:
                shed[tier] += 1
        except openai.APIError:
            with lock:
                failed[tier] += 1

    replay([(arrival, (tier, number)) for number, (arrival, tier) in enumerate(plan)], send)
    return [
        TierResult(
            mode,
            tier,
            sum(1 for _, planned in plan if planned == tier),
            shed[tier],
            failed[tier],
            *percentiles_ms(outcomes[tier]),
        )
        for tier in tiers
    ]


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=("policies", "overload", "all"), default="all")
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.5, help="Requests per second (Poisson).")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=288,
        help="KV blocks of 16 tokens per replica: each tenant's system prompt takes about 61 (970 tokens of "
        "the small model), so a replica holds about 4 of the 12 tenants' prefixes.",
    )
    parser.add_argument(
        "--load-bound-percent",
        type=int,
        default=200,
        help="routing.loadBoundPercent of prefix-hash and cache-aware. With a few requests in flight, the "
        "default 125 lets no replica hold two while the others hold none, so a tenant's second concurrent "
        "request would land where its prefix is not cached.",
    )
    parser.add_argument("--overload-requests", type=int, default=1500)
    parser.add_argument(
        "--overload-rate",
        type=float,
        default=12.0,
        help="Requests per second (Poisson), above what one serves.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def make_small_model(directory: Path) -> Path:
    """The `small` preset's weights, made by the kvfleet command of this environment."""
    kvfleet = Path(sys.executable).parent / "kvfleet"
    make = [str(kvfleet), "make-model", "--arch", "llama", "--preset", "small", str(directory)]
    subprocess.run(make, check=True, capture_output=True)
    return directory


def start_gateway(cluster: LocalCluster) -> str:
    """Installs the chart with one gateway, and the benchmark's namespace; the gateway's URL once ready."""
    values = {"gateway.enabled": "true", "gateway.replicaCount": "1"}
    install_chart(cluster, values | {"gateway.maxQueue": str(OVERLOAD_MAX_QUEUE)})
    cluster.kubectl("create", "namespace", NAMESPACE)
    gateways = gateway_endpoints(cluster, OPERATOR_NAMESPACE)
    return wait_for("a ready gateway", gateways.refresh, 120)[0].base_url


def run_policies(
    cluster: LocalCluster,
    gateway_url: str,
    model_dir: Path,
    args: argparse.Namespace,
    requests: list[tuple[float, str, str]],
) -> list[PolicyResult]:
    """Each policy in turn, each row printed as it is measured: a run cut short keeps what it measured."""
    print("| policy | replicas | requests | failed | TTFT p50 ms | TTFT p99 ms | hit rate |")
    print("|---|---|---|---|---|---|---|", flush=True)
    # One replica alone first, with the whole fleet's cache: the hit rate to measure against.
    runs = [("least-request", 1, args.kv_blocks * args.replicas)]
    runs += [(policy, args.replicas, args.kv_blocks) for policy in POLICIES]
    results = []
    for policy, replicas, kv_blocks in runs:
        result = run_policy(
            cluster, gateway_url, model_dir, policy, replicas, kv_blocks, args.load_bound_percent, requests
        )
        results.append(result)
        print(
            f"| {result.policy} | {result.replicas} | {result.requests} | {result.failed} | "
            f"{result.ttft_p50_ms} | {result.ttft_p99_ms} | {result.hit_rate:.1%} |",
            flush=True,
        )
    return results


def print_overload(rows: list[TierResult]) -> None:
    print("\n| mode | tier | requests | shed (429) | failed | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.mode} | {row.tier} | {row.requests} | {row.shed} | {row.failed} | "
            f"{row.ttft_p50_ms} | {row.ttft_p99_ms} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A stopped benchmark still stops the cluster and every pod process it started.
    signal.signal(signal.SIGTERM, _interrupted)
    requests = workload(args.tenants, args.requests, args.rate, args.seed)
    policies: list[PolicyResult] = []
    overload: list[TierResult] = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-gateway-") as scratch:
        small_dir = make_small_model(Path(scratch) / "small")
        with LocalCluster(Path(scratch) / "cluster", ClusterConfig()) as cluster:
            gateway_url = start_gateway(cluster)
            if args.scenario in ("policies", "all"):
                policies = run_policies(cluster, gateway_url, small_dir, args, requests)
            if args.scenario in ("overload", "all"):
                overload = run_overload(
                    cluster, gateway_url, small_dir, args.overload_requests, args.overload_rate, args.seed
                )
                print_overload(overload)
            if args.json is not None:
                document = {
                    "policies": [asdict(r) for r in policies],
                    "overload": [asdict(r) for r in overload],
                }
                args.json.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
