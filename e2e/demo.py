"""`make demo`: the whole product on this machine, on a real Kubernetes control plane.

    python -m e2e.demo            # from the repository root, in the project's environment
    KEEP=1 python -m e2e.demo     # leave the cluster running afterwards (its kubeconfig is printed)
    IMAGES=1 python -m e2e.demo   # the pods run from the images `make images` built (podman)

Builds the control plane's binaries on first use (progress shown), starts a local cluster (kwok's fake GPU
nodes, kvfleet pods run as real processes), installs the Helm chart with its fleet gateway, applies
examples/tiny-cpu.yaml with a tiny model made on the spot, waits for it, chats with it through the gateway
with the openai SDK, runs a short burst of requests while showing the replicas scale with `kubectl get` and
the gateway's routing decisions, scales a second service from zero with a request the gateway holds, and
tears everything down.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kvfleet.operator.api import qualified_name

from e2e.cluster import AttachedCluster, ensure_binaries
from e2e.cluster.cluster import default_cache_dir
from e2e.fleet.chart import OPERATOR_NAMESPACE, RELEASE, install_chart
from e2e.fleet.gateway import gateway_endpoints
from e2e.fleet.manifests import deployment_path, tiny_example
from e2e.fleet.observe import FirstAnswers, ReplicaHistory, wait_ready
from e2e.fleet.traffic import ChatLoad, Endpoint, ReadyEndpoints, chat

CLUSTER_NAME = "demo"
NAMESPACE = "demo"
QUESTIONS = (
    "What does a fleet of inference servers need?",
    "Say hello in three words.",
    "Why scale on queue depth?",
)
# The example wants 4 requests per replica and runs 16 at a time: 12 clients ask for 3 replicas.
BURST_CLIENTS = 12
# Long enough for the replicas the autoscaler adds to load their model and take a share.
BURST_SECONDS = 45.0
SETTLE_TIMEOUT_SECONDS = 150.0
ROUTING_METRIC = "kvfleet_gateway_routing_decisions_total"
# The second service: idle this long, it goes to zero; the gateway then holds its next request.
ZERO_NAME = "tiny-at-zero"
ZERO_IDLE_SECONDS = 10


def step(number: int, total: int, text: str) -> None:
    print(f"\n\033[1m[{number}/{total}] {text}\033[0m", flush=True)


def show(result: subprocess.CompletedProcess[str], indent: str = "    ") -> None:
    for line in result.stdout.rstrip().splitlines():
        print(f"{indent}{line}", flush=True)


def python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def start_cluster(directory: Path, nodes: int, gpus_per_node: int, images: bool) -> AttachedCluster:
    """The cluster runs in a supervisor process (`python -m e2e.cluster up --detach`): KEEP=1 can leave it."""
    command = python_module("e2e.cluster", "up", "--detach", "--dir", str(directory))
    command += ["--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node)] + (
        ["--images"] if images else []
    )
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return AttachedCluster(directory)


def stop_cluster(directory: Path) -> None:
    subprocess.run(python_module("e2e.cluster", "down", "--dir", str(directory)), check=False)


def make_model(directory: Path) -> Path:
    path = directory / "models" / "tiny-llama"
    if not (path / "config.json").exists():
        kvfleet = Path(sys.executable).parent / "kvfleet"
        subprocess.run(
            [str(kvfleet), "make-model", "--arch", "llama", "--preset", "tiny", str(path)], check=True
        )
    return path


def replicas_line(cluster: AttachedCluster, name: str) -> tuple[int, int]:
    deployment = cluster.api.get(deployment_path(NAMESPACE, name))
    return deployment["spec"].get("replicas", 1), deployment.get("status", {}).get("readyReplicas", 0)


def watch_replicas(
    cluster: AttachedCluster, name: str, seconds: float, until: Callable[[tuple[int, int]], bool]
) -> None:
    """Prints `kubectl get inferenceservice` and the pods whenever the desired or ready count changes, for
    `seconds` or until `until((desired, ready))` holds."""
    started = time.monotonic()
    last: tuple[int, int] | None = None
    while time.monotonic() - started < seconds:
        current = replicas_line(cluster, name)
        if current != last:
            print(
                f"  t={time.monotonic() - started:4.0f}s  desired {current[0]}, ready {current[1]}",
                flush=True,
            )
            show(cluster.kubectl("get", "inferenceservice", name, "-n", NAMESPACE))
            show(cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide"), indent="      ")
            last = current
        if until(current):
            return
        time.sleep(1.0)


def gateways(cluster: AttachedCluster) -> ReadyEndpoints:
    """The ready gateway pods (a Service would pick one; this cluster's pods have loopback IPs)."""
    return gateway_endpoints(cluster, OPERATOR_NAMESPACE)


def routing_decisions(cluster: AttachedCluster, model: str) -> dict[str, float]:
    """Requests each replica got from the gateways, summed over them: replica URL -> count."""
    counts: dict[str, float] = {}
    for gateway in gateways(cluster).refresh():
        with urllib.request.urlopen(f"http://{gateway.ip}:{gateway.port}/metrics", timeout=5) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(ROUTING_METRIC) and f'model="{model}"' in line:
                    replica = line.split('endpoint="', 1)[1].split('"', 1)[0]
                    counts[replica] = counts.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def scale_from_zero(cluster: AttachedCluster, model: Path, gateway: Endpoint) -> None:
    manifest = tiny_example(model, name=ZERO_NAME)
    manifest["spec"]["model"]["servedName"] = ZERO_NAME
    manifest["spec"]["scaling"] = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleToZeroAfterSeconds": ZERO_IDLE_SECONDS,
        "scaleDownDelaySeconds": 0,
    }
    show(cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(manifest)))
    print(f"    minReplicas 0: it loads once, then goes to zero after {ZERO_IDLE_SECONDS}s idle", flush=True)
    wait_ready(cluster.api, NAMESPACE, ZERO_NAME, timeout=180)
    watch_replicas(cluster, ZERO_NAME, SETTLE_TIMEOUT_SECONDS, until=lambda replicas: replicas == (0, 0))
    print(f"    > a request for {ZERO_NAME} through the gateway, which holds it while a replica starts")
    sent = time.monotonic()
    answer = chat(gateway, "Are you awake?", max_tokens=8, model=qualified_name(NAMESPACE, ZERO_NAME))
    print(f"      {answer.strip()!r} after {time.monotonic() - sent:.1f}s", flush=True)
    show(cluster.kubectl("get", "inferenceservice", ZERO_NAME, "-n", NAMESPACE))


def install_with_gateway(cluster: AttachedCluster) -> None:
    started = time.monotonic()
    install_chart(cluster, {"gateway.enabled": "true"})
    print(f"    installed in {time.monotonic() - started:.0f}s", flush=True)
    show(cluster.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE))


def apply_example(cluster: AttachedCluster, directory: Path) -> tuple[Path, dict[str, Any]]:
    """examples/tiny-cpu.yaml with a tiny model made on the spot: the model's folder and the manifest."""
    model = make_model(directory)
    manifest = tiny_example(model)
    print(f"    model.uri: {manifest['spec']['model']['uri']}", flush=True)
    cluster.kubectl("create", "namespace", NAMESPACE)
    show(cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(manifest)))
    return model, manifest


def wait_example_ready(cluster: AttachedCluster, name: str) -> None:
    started = time.monotonic()
    wait_ready(cluster.api, NAMESPACE, name, timeout=180)
    print(f"    Ready after {time.monotonic() - started:.0f}s", flush=True)
    show(cluster.kubectl("get", "inferenceservices", "-n", NAMESPACE))


def chat_through_gateway(cluster: AttachedCluster, served_name: str) -> Endpoint:
    """A few questions to served_name through a gateway; that gateway."""
    gateway = gateways(cluster).refresh()[0]
    print(f"    openai.OpenAI(base_url={gateway.base_url!r})  # gateway pod {gateway.pod}", flush=True)
    for question in QUESTIONS:
        answer = chat(gateway, question, max_tokens=24, model=served_name)
        print(f"    > {question}\n      {answer.strip()!r}", flush=True)
    print("    (a tiny model with random weights: the words are noise, the serving is real)", flush=True)
    return gateway


def burst(cluster: AttachedCluster, name: str, served_name: str) -> None:
    """Load from many clients while the replicas are shown, then how soon each added replica answered and
    where the gateways sent the requests."""
    with (
        ReplicaHistory(cluster.api, NAMESPACE, name) as history,
        ReadyEndpoints(cluster.api, NAMESPACE, name) as replicas,
        FirstAnswers(replicas) as answers,
    ):
        first_replicas = {endpoint.pod for endpoint in replicas.current()}
        with gateways(cluster) as spread, ChatLoad(spread, BURST_CLIENTS, 128, model=served_name) as load:
            watch_replicas(cluster, name, BURST_SECONDS, until=lambda replicas: False)
    print(f"    {len(load.successes())} requests answered, {len(load.failures())} failed", flush=True)
    added = sorted((at, pod) for pod, at in answers.snapshot().items() if pod not in first_replicas)
    for number, (answered, pod) in enumerate(added, start=len(first_replicas) + 1):
        decided = history.first(lambda sample, n=number: sample.desired >= n)
        ready = history.first(lambda sample, n=number: sample.ready >= n)
        if decided is not None and ready is not None:
            print(
                f"    replica {number} ({pod}): Ready {ready.at - decided.at:.1f}s and its first answer "
                f"{answered - decided.at:.1f}s after the scale-up decision",
                flush=True,
            )
    unanswered = max(sample.desired for sample in history.snapshot()) - len(first_replicas) - len(added)
    if unanswered > 0:
        print(f"    {unanswered} added replica(s) answered nothing before the burst ended", flush=True)
    print("    the gateways' routing decisions (least-request), requests per replica:", flush=True)
    for replica, count in sorted(routing_decisions(cluster, served_name).items()):
        print(f"      {replica}  {count:.0f}", flush=True)


def settle(cluster: AttachedCluster, name: str) -> None:
    """Back to one replica, then the service's events (the autoscaler's decisions among them)."""
    watch_replicas(cluster, name, SETTLE_TIMEOUT_SECONDS, until=lambda replicas: replicas == (1, 1))
    selector = f"involvedObject.kind=InferenceService,involvedObject.name={name}"
    columns = "custom-columns=REASON:.reason,MESSAGE:.message"
    events = cluster.kubectl(
        "get",
        "events",
        "-n",
        NAMESPACE,
        "--field-selector",
        selector,
        "--sort-by=.lastTimestamp",
        "-o",
        columns,
    )
    show(events)
    show(cluster.kubectl("get", "inferenceservices", "-n", NAMESPACE))


def run_demo(directory: Path, keep: bool, nodes: int, gpus_per_node: int, images: bool) -> None:
    total = 9
    step(1, total, "building the control plane's binaries (first run only: about 10 minutes on 2 cores)")
    ensure_binaries()

    pods = "pods as containers of the built images" if images else "pods as processes"
    step(2, total, f"starting a local cluster: {nodes} fake GPU nodes x {gpus_per_node} GPUs, {pods}")
    try:
        cluster = start_cluster(directory, nodes, gpus_per_node, images)
        print(f"    kubeconfig: {cluster.kubeconfig}", flush=True)
        show(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.count"))

        install = f"helm install {RELEASE} charts/kvfleet --namespace {OPERATOR_NAMESPACE}"
        step(3, total, f"{install} --set gateway.enabled=true")
        install_with_gateway(cluster)

        step(4, total, "a tiny model (kvfleet make-model) and kubectl apply -f examples/tiny-cpu.yaml")
        model, manifest = apply_example(cluster, directory)
        name = manifest["metadata"]["name"]

        step(5, total, "waiting for the InferenceService to be Ready")
        wait_example_ready(cluster, name)

        step(6, total, "chat completions through the fleet gateway with the openai SDK")
        # The gateway watches every namespace: a model is named with its service's.
        served_name = qualified_name(NAMESPACE, manifest["spec"]["model"]["servedName"])
        gateway = chat_through_gateway(cluster, served_name)

        step(
            7,
            total,
            f"a {BURST_SECONDS:.0f}s burst from {BURST_CLIENTS} clients through the gateways: "
            "the autoscaler adds replicas",
        )
        burst(cluster, name, served_name)

        step(
            8,
            total,
            "idle: back to minReplicas after the example's windows (stable 30s, scale-down delay 30s)",
        )
        settle(cluster, name)

        step(9, total, "scale from zero: a second service, idle at zero until a request arrives")
        scale_from_zero(cluster, model, gateway)
    except BaseException:
        if keep:
            print(f"\nthe demo failed; KEEP=1 leaves the cluster for a look: {directory}", file=sys.stderr)
            print(f"stop it with: {sys.executable} -m e2e.cluster down --dir {directory}", file=sys.stderr)
        else:
            print("\nthe demo failed; stopping the cluster", file=sys.stderr, flush=True)
            stop_cluster(directory)
        raise
    if keep:
        print_kept(cluster, directory)
        return
    print("\ntearing down", flush=True)
    stop_cluster(directory)


def print_kept(cluster: AttachedCluster, directory: Path) -> None:
    print(
        f"\nKEEP=1: the cluster keeps running.\n"
        f"    export KUBECONFIG={cluster.kubeconfig}\n"
        f"    export PATH={cluster.bin_dir}:$PATH   # kubectl and helm\n"
        f"    kubectl get inferenceservices -A\n"
        f"  pod logs: {directory / 'pods'}\n"
        f"  stop it:  {sys.executable} -m e2e.cluster down --dir {directory}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--keep",
        action="store_true",
        default=os.environ.get("KEEP", "") not in ("", "0"),
        help="leave the cluster running (also KEEP=1)",
    )
    parser.add_argument(
        "--dir", default=None, help=f"cluster folder (default: $KVFLEET_CACHE/clusters/{CLUSTER_NAME})"
    )
    parser.add_argument(
        "--images",
        action="store_true",
        default=os.environ.get("IMAGES", "") not in ("", "0"),
        help="run the pods from the images `make images` built (also IMAGES=1)",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args(argv)
    directory = Path(args.dir) if args.dir else default_cache_dir() / "clusters" / CLUSTER_NAME
    try:
        run_demo(directory.resolve(), args.keep, args.nodes, args.gpus_per_node, args.images)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
