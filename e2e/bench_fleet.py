"""Fleet-scale benchmark of the operator on the local control plane (kwok only; no pod runner):

    python -m e2e.bench_fleet                      # 200 fake GPU nodes, 500 InferenceServices at once
    python -m e2e.bench_fleet --nodes 50 --services 100 --json result.json

The chart is installed with its operator Deployment scaled to 0 (CRDs, RBAC, PriorityClasses); the operator
runs as a local process with a token of the chart's ServiceAccount, so it has exactly the chart's rights.
kwok plays every pod (Running and Ready, no process). Measured: reconcile latency (the create call returned
-> the Deployment's ADDED event), the time until every InferenceService is Ready, and the operator's CPU
time and peak RSS (VmHWM) from /proc, during the burst and in the steady state after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import ApiError, ClusterConfig, KubeAPI, LocalCluster, NodeShape
from e2e.cluster.cluster import free_port
from e2e.cluster.kube_api import write_kubeconfig
from e2e.cluster.processes import ManagedProcess
from e2e.fleet.chart import OPERATOR_NAMESPACE, RELEASE, install_chart
from e2e.fleet.manifests import API_VERSION, fake_gpu_service, services_path
from e2e.fleet.observe import is_ready

CLOCK_TICKS = 100  # USER_HZ: /proc/<pid>/stat times are in these on Linux


# -- the operator's process, read from /proc ----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


# -- watches that time-stamp what they see -----------------------------------------------------------------


class TimedWatch(threading.Thread):
    """Watches a collection from a resource version, calling on_event(type, object, arrival time), and
    resumes where it stopped when the server ends a watch."""

    def __init__(
        self,
        api: KubeAPI,
        path: str,
        resource_version: str,
        on_event: Callable[[str, dict[str, Any], float], None],
    ) -> None:
        super().__init__(name=f"watch-{path}", daemon=True)
        self.api = api
        self.path = path
        self.resource_version = resource_version
        self.on_event = on_event
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._stream: Any = None

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._stream = self.api.watch(self.path, self.resource_version, timeout_seconds=300)
                for event in self._stream:
                    arrived = time.monotonic()
                    if event["type"] == "ERROR":
                        raise ApiError(
                            "WATCH", self.path, event["object"].get("code", 0), str(event["object"])
                        )
                    self.resource_version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self.on_event(event["type"], event["object"], arrived)
        except BaseException as error:
            if not self._stopping.is_set():
                self.error = error

    def stop(self) -> None:
        self._stopping.set()
        if self._stream is not None:
            self._stream.close()
        self.join(timeout=10)


# -- the run ------------------------------------------------------------------------------------------------


@dataclass
class FleetResult:
    nodes: int
    services: int
    namespaces: int
    apply_seconds: float
    reconcile_p50_seconds: float
    reconcile_p90_seconds: float
    reconcile_p99_seconds: float
    reconcile_max_seconds: float
    # create -> the operator's first write to the object (its finalizer): when kopf took it up
    pickup_p50_seconds: float
    pickup_p99_seconds: float
    all_deployments_seconds: float
    all_ready_seconds: float
    operator_cpu_seconds_to_ready: float
    operator_mean_cores_to_ready: float
    operator_steady_cores: float
    operator_peak_rss_mib: float
    operator_rss_after_mib: float
    # CPU seconds of each control-plane component from the first create until every service was Ready.
    control_plane_cpu_seconds: dict[str, float]
    # The API server's busiest request kinds (all clients) over the same time.
    api_requests_to_ready: dict[str, int]
    host_load_average: float


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[index]


def operator_kubeconfig(cluster: LocalCluster, path: Path) -> Path:
    """A kubeconfig with a token of the chart's ServiceAccount: the operator gets the chart's RBAC only."""
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 7200},
    }
    token = cluster.api.create(
        f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{RELEASE}/token", request
    )["status"]["token"]
    return write_kubeconfig(path, cluster.server, cluster.ca_cert, "operator", token)


def api_requests(api: KubeAPI) -> Counter[str]:
    """The API server's request counts: "VERB resource[/subresource]" -> requests so far."""
    with api._open("GET", "/metrics") as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total" and sample.labels.get("verb") != "WATCH":
                labels = sample.labels
                resource = labels.get("resource", "") + (
                    f"/{labels['subresource']}" if labels.get("subresource") else ""
                )
                counts[f"{labels.get('verb')} {resource}"] += int(sample.value)
    return counts


Key = tuple[str, str]  # an InferenceService: (namespace, name)


@dataclass
class Timeline:
    """When each InferenceService was created (the create call returned), got its Deployment, was taken up
    by the operator (its first write, kopf's finalizer) and became Ready: monotonic seconds, as the watches
    saw them arrive."""

    created: dict[Key, float] = field(default_factory=dict)
    deployments: dict[Key, float] = field(default_factory=dict)
    noticed: dict[Key, float] = field(default_factory=dict)
    ready: dict[Key, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self, api: KubeAPI) -> list[TimedWatch]:
        """Started watches of the Deployments and the InferenceServices, from now on."""
        service_list = f"/apis/{API_VERSION}/inferenceservices"
        watches = [
            TimedWatch(
                api,
                "/apis/apps/v1/deployments",
                api.get("/apis/apps/v1/deployments")["metadata"]["resourceVersion"],
                self._on_deployment,
            ),
            TimedWatch(
                api, service_list, api.get(service_list)["metadata"]["resourceVersion"], self._on_service
            ),
        ]
        for watch in watches:
            watch.start()
        return watches

    def create(self, api: KubeAPI, key: Key) -> None:
        namespace, name = key
        manifest = fake_gpu_service(
            name, gpus=1, scaling={"replicas": None, "minReplicas": 1, "maxReplicas": 2}
        )
        api.create(services_path(namespace), manifest)
        returned = time.monotonic()
        with self.lock:
            self.created[key] = returned

    def ready_count(self) -> int:
        with self.lock:
            return len(self.ready)

    def _on_deployment(self, kind: str, obj: dict[str, Any], arrived: float) -> None:
        meta = obj["metadata"]
        if kind == "ADDED" and meta["namespace"].startswith("fleet-"):
            with self.lock:
                self.deployments.setdefault((meta["namespace"], meta["name"]), arrived)

    def _on_service(self, kind: str, obj: dict[str, Any], arrived: float) -> None:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        if kind == "MODIFIED" and meta.get("finalizers"):
            with self.lock:
                self.noticed.setdefault(key, arrived)
        if kind in ("ADDED", "MODIFIED") and is_ready(obj):
            with self.lock:
                self.ready.setdefault(key, arrived)


@dataclass(frozen=True)
class Usage:
    """CPU seconds of the operator and of each control-plane component, and the API server's request counts,
    so far."""

    operator_cpu: float
    control_plane_cpu: dict[str, float]
    requests: Counter[str]

    @classmethod
    def now(cls, api: KubeAPI, operator_pid: int, components: dict[str, int]) -> Usage:
        operator_cpu = cpu_seconds(operator_pid)
        control_plane = {name: cpu_seconds(pid) for name, pid in components.items()}
        return cls(operator_cpu, control_plane, api_requests(api))

    def __sub__(self, before: Usage) -> Usage:
        return Usage(
            self.operator_cpu - before.operator_cpu,
            {
                name: round(seconds - before.control_plane_cpu[name], 1)
                for name, seconds in self.control_plane_cpu.items()
            },
            self.requests - before.requests,
        )


def create_namespaces(api: KubeAPI, count: int) -> list[str]:
    namespaces = [f"fleet-{index}" for index in range(count)]
    for namespace in namespaces:
        api.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        )
    return namespaces


def start_operator(cluster: LocalCluster, args: argparse.Namespace, state_dir: Path) -> ManagedProcess:
    """The operator as a local process with the chart's rights, once past its start-up."""
    kubeconfig = operator_kubeconfig(cluster, state_dir / "operator.kubeconfig")
    operator = cluster.launch("kvfleet-operator", [
        str(args.operator_program), "--log-level", "info", "operator",
        f"--kubeconfig={kubeconfig}", "--bind=127.0.0.1",
        f"--metrics-port={free_port()}", f"--health-port={free_port()}", *args.operator_arg,
    ])  # fmt: skip
    time.sleep(args.settle_seconds)  # start-up (imports, peering, first lists) is not reconcile latency
    if not operator.running():
        raise RuntimeError(operator.describe_exit())
    return operator


def wait_all_ready(
    timeline: Timeline,
    count: int,
    timeout: float,
    began: float,
    operator: ManagedProcess,
    watches: list[TimedWatch],
) -> None:
    """Until count services are Ready; fails when the operator exits or a watch fails."""
    deadline = began + timeout
    while True:
        done = timeline.ready_count()
        if done >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{done} of {count} Ready after {timeout:.0f}s")
        if not operator.running():
            raise RuntimeError(operator.describe_exit())
        for watch in watches:
            if watch.error is not None:
                raise RuntimeError(f"a watch failed: {watch.error}")
        time.sleep(0.2)


def steady_state(operator: ManagedProcess, args: argparse.Namespace) -> tuple[float, dict[str, int]]:
    """The operator's mean cores once the controllers settled, and its memory after."""
    print(
        f"every service Ready; {args.steady_delay:.0f}s for the controllers to settle, "
        f"then {args.steady_seconds:.0f}s of steady state",
        flush=True,
    )
    time.sleep(args.steady_delay)
    began, cpu = time.monotonic(), cpu_seconds(operator.pid)
    time.sleep(args.steady_seconds)
    cores = (cpu_seconds(operator.pid) - cpu) / (time.monotonic() - began)
    return cores, memory_kib(operator.pid)


def run(args: argparse.Namespace, state_dir: Path) -> FleetResult:
    config = ClusterConfig(nodes=args.nodes, node_shape=NodeShape(gpus=args.gpus_per_node), pod_runner=False)
    print(f"starting a cluster with {args.nodes} fake GPU nodes (no pod runner)", flush=True)
    with LocalCluster(state_dir, config) as cluster:
        api = cluster.api
        install_chart(cluster, values={"replicaCount": "0"})
        namespaces = create_namespaces(api, args.namespaces)
        operator = start_operator(cluster, args, state_dir)
        timeline = Timeline()
        watches = timeline.watch(api)
        components = json.loads((state_dir / "cluster.json").read_text())["pids"]
        before = Usage.now(api, operator.pid, components)
        print(f"operator pid {operator.pid}", flush=True)
        keys = [(namespaces[index % len(namespaces)], f"model-{index:04d}") for index in range(args.services)]
        print(
            f"creating {args.services} InferenceServices in {len(namespaces)} namespaces at once", flush=True
        )
        burst_began = time.monotonic()
        with ThreadPoolExecutor(args.create_threads) as pool:
            list(pool.map(lambda key: timeline.create(api, key), keys))
        apply_seconds = time.monotonic() - burst_began
        wait_all_ready(timeline, len(keys), args.timeout, burst_began, operator, watches)
        to_ready = Usage.now(api, operator.pid, components) - before
        steady_cores, memory = steady_state(operator, args)
        for watch in watches:
            watch.stop()
        return fleet_result(
            args, len(namespaces), keys, timeline, burst_began, apply_seconds, to_ready, steady_cores, memory
        )


def fleet_result(
    args: argparse.Namespace,
    namespaces: int,
    keys: list[Key],
    timeline: Timeline,
    burst_began: float,
    apply_seconds: float,
    to_ready: Usage,
    steady_cores: float,
    memory: dict[str, int],
) -> FleetResult:
    latencies = [timeline.deployments[key] - timeline.created[key] for key in keys]
    pickup = [timeline.noticed[key] - timeline.created[key] for key in keys]
    all_ready_at = max(timeline.ready.values())
    load_average = float(Path("/proc/loadavg").read_text().split()[0])
    return FleetResult(
        nodes=args.nodes,
        services=args.services,
        namespaces=namespaces,
        apply_seconds=round(apply_seconds, 2),
        reconcile_p50_seconds=round(statistics.median(latencies), 3),
        reconcile_p90_seconds=round(percentile(latencies, 0.90), 3),
        reconcile_p99_seconds=round(percentile(latencies, 0.99), 3),
        reconcile_max_seconds=round(max(latencies), 3),
        pickup_p50_seconds=round(statistics.median(pickup), 3),
        pickup_p99_seconds=round(percentile(pickup, 0.99), 3),
        all_deployments_seconds=round(max(timeline.deployments[key] for key in keys) - burst_began, 2),
        all_ready_seconds=round(all_ready_at - burst_began, 2),
        operator_cpu_seconds_to_ready=round(to_ready.operator_cpu, 1),
        operator_mean_cores_to_ready=round(to_ready.operator_cpu / (all_ready_at - burst_began), 2),
        operator_steady_cores=round(steady_cores, 3),
        operator_peak_rss_mib=round(memory["VmHWM"] / 1024, 1),
        operator_rss_after_mib=round(memory["VmRSS"] / 1024, 1),
        control_plane_cpu_seconds=to_ready.control_plane_cpu,
        api_requests_to_ready=dict(to_ready.requests.most_common(args.top_requests)),
        host_load_average=load_average,
    )


def report(result: FleetResult) -> str:
    latency = " / ".join(
        f"{value:.3f}"
        for value in (
            result.reconcile_p50_seconds,
            result.reconcile_p90_seconds,
            result.reconcile_p99_seconds,
            result.reconcile_max_seconds,
        )
    )
    fleet = (
        f"{result.nodes} fake GPU nodes, {result.services} InferenceServices, {result.namespaces} namespaces"
    )
    cpu = f"{result.operator_cpu_seconds_to_ready:.1f} s ({result.operator_mean_cores_to_ready:.2f} cores)"
    components = ", ".join(
        f"{name} {seconds:.1f} s" for name, seconds in result.control_plane_cpu_seconds.items()
    )
    rows = [
        ("fleet", fleet),
        ("create calls", f"{result.apply_seconds:.2f} s"),
        ("reconcile latency p50 / p90 / p99 / max", f"{latency} s"),
        (
            "pick-up: create -> finalizer p50 / p99",
            f"{result.pickup_p50_seconds:.3f} / {result.pickup_p99_seconds:.3f} s",
        ),
        ("every Deployment exists", f"{result.all_deployments_seconds:.1f} s after the first create"),
        ("every InferenceService Ready", f"{result.all_ready_seconds:.1f} s after the first create"),
        ("operator CPU until all Ready", cpu),
        (
            "operator CPU, steady state (every 2 s a pass per service)",
            f"{result.operator_steady_cores:.3f} cores",
        ),
        (
            "operator RSS peak / after",
            f"{result.operator_peak_rss_mib:.0f} / {result.operator_rss_after_mib:.0f} MiB",
        ),
        ("control plane CPU until all Ready", components),
        ("host load average (1 min)", f"{result.host_load_average:.1f}"),
        (
            "API requests until all Ready",
            str(sum(result.api_requests_to_ready.values())) + " in the kinds below",
        ),
    ]
    rows += [(f"  {kind}", str(count)) for kind, count in result.api_requests_to_ready.items()]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench_fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--services", type=int, default=500)
    parser.add_argument("--namespaces", type=int, default=10)
    parser.add_argument("--create-threads", type=int, default=16)
    parser.add_argument(
        "--settle-seconds", type=float, default=10.0, help="operator start-up before the burst"
    )
    parser.add_argument(
        "--steady-delay", type=float, default=20.0, help="wait after all Ready before sampling"
    )
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds until every service must be Ready"
    )
    parser.add_argument(
        "--operator-program",
        type=Path,
        default=Path(sys.executable).parent / "kvfleet",
        help="the kvfleet command to run the operator with (e.g. a build under test)",
    )
    parser.add_argument(
        "--operator-arg",
        action="append",
        default=[],
        help="an extra option for `kvfleet operator` (repeatable), e.g. --operator-arg=--api-concurrency=8",
    )
    parser.add_argument("--top-requests", type=int, default=12, help="request kinds to list")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--dir", type=Path, default=None, help="cluster folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.dir is not None:
        result = run(args, args.dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="kvfleet-bench-fleet-") as directory:
            result = run(args, Path(directory))
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
