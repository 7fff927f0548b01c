"""A real Kubernetes control plane on loopback, with kwok's fake GPU nodes and the pod runner.

    with LocalCluster(state_dir) as cluster:
        cluster.kubectl("get", "nodes")

etcd, kube-apiserver (token auth, RBAC), kube-controller-manager and kube-scheduler run as local processes
from the binaries build.sh made; kwok plays the kubelets of N fake nodes that advertise nvidia.com/gpu. Every
process is stopped by its PID when the context exits, including after a failed start. A cluster DNS server
and a Service proxy (service_network.py) give pods Service names and routing.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import yaml

from .binaries import ensure_binaries
from .cluster_dns import CLUSTER_DOMAIN, host_nameserver
from .fake_nodes import KWOK_NODE_SELECTOR, NodeShape, fake_node, fake_node_names
from .kube_api import ApiError, KubeAPI, write_kubeconfig
from .kwok_stages import kwok_stages
from .pki import ClusterPKI, make_pki
from .pod_runner import PodRunner
from .pod_spec import DEFAULT_IMAGE_PATTERN
from .processes import Ledger, ManagedProcess, start_process, tail
from .service_network import ServiceNetwork

log = logging.getLogger("kvfleet.e2e.cluster")

ADMIN_USER = "kvfleet-admin"
NO_ENDPOINT_CONTROLLERS = (
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
)
# Room for a fleet of thousands of Services (a /24 ran out at 253 in the fleet benchmark).
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int = 4
    node_shape: NodeShape = field(default_factory=NodeShape)
    # Run pods whose image matches runner_image_pattern as real processes; off: kwok fakes every pod.
    pod_runner: bool = True
    runner_image_pattern: str = DEFAULT_IMAGE_PATTERN
    # Pod images the runner runs from local images with podman (pod image -> local image), not as processes.
    container_images: Mapping[str, str] = field(default_factory=dict)
    # Client rate limits of the controller manager and scheduler (upstream's 20/30 throttle fleets of
    # hundreds of Deployments long before the API server is busy).
    kube_api_qps: int = 100
    kube_api_burst: int = 200
    start_timeout: float = 120.0
    # The nameserver (address, port) the cluster DNS forwards names outside the cluster to; None: the host's
    # own, from /etc/resolv.conf.
    dns_upstream: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        fake_node_names(self.nodes)  # validates the count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def claim_loopback_subnet(lock_dir: Path) -> tuple[str, IO[str]]:
    """A 127.N.0.0/16 range no other local cluster on this machine uses, held by a lock until released.

    Pods bind their server to their own IP, and Service addresses are listened on, so two clusters handing
    out the same addresses would collide.
    """
    lock_dir.mkdir(parents=True, exist_ok=True)
    for second_octet in range(1, 255):
        handle = (lock_dir / f"127.{second_octet}.lock").open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return f"127.{second_octet}.0.0/16", handle
    raise RuntimeError(f"every 127.N.0.0/16 pod range is held by another local cluster (locks in {lock_dir})")


def _wait_until(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    watched: Sequence[ManagedProcess] = (),
    interval: float = 0.2,
) -> None:
    """Polls check() until it returns True; fails early, with its log, if a watched process exits."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        for process in watched:
            if not process.running():
                raise RuntimeError(f"while waiting for {what}: {process.describe_exit()}")
        try:
            if check():
                return
            last_error = None
        except (OSError, ApiError, ValueError, KeyError) as error:
            last_error = error
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- {p.log_path}:\n{tail(p.log_path)}" for p in watched)
            raise TimeoutError(f"{what} not reached within {timeout:.0f}s (last error: {last_error}){logs}")
        time.sleep(interval)


def _http_ok(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> bool:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=2) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


class ClusterTools:
    """kubectl, helm and an environment pointed at a cluster, given its kubeconfig and binaries."""

    kubeconfig: Path
    bin_dir: Path

    def env(self) -> dict[str, str]:
        """This process's environment pointed at the cluster (KUBECONFIG) with the binaries on PATH."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", args, check, input)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run("helm", args, check, None)

    def _run(
        self, tool: str, args: Sequence[str], check: bool, input: str | None
    ) -> subprocess.CompletedProcess[str]:
        """check: fail with the tool's output on a non-zero exit."""
        result = subprocess.run(
            [str(self.bin_dir / tool), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            input=input,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{tool} {' '.join(args)} failed with {result.returncode}:\n{result.stdout}{result.stderr}"
            )
        return result


class LocalCluster(ClusterTools):
    """Starts the control plane on entry (or start()), stops every process it started on exit (or stop())."""

    def __init__(
        self,
        state_dir: Path,
        config: ClusterConfig | None = None,
        bin_dir: Path | None = None,
        runner_programs: dict[str, str] | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.config = config or ClusterConfig()
        self._bin_dir = bin_dir
        self._runner_programs = dict(runner_programs or {})
        self.log_dir = self.state_dir / "logs"
        self.kubeconfig = self.state_dir / "admin.kubeconfig"
        self._token_file = self.state_dir / "tokens.csv"
        self.token = ""
        self.server = ""
        self.pod_cidr = ""
        self.network: ServiceNetwork | None = None
        self.ca_cert = self.state_dir / "pki" / "ca.crt"
        self.pod_runner: PodRunner | None = None
        self._ledger = Ledger(self.state_dir / "processes.json")
        self._processes: list[ManagedProcess] = []
        self._subnet_locks: list[IO[str]] = []
        self._api: KubeAPI | None = None

    # -- public interface -------------------------------------------------------------------------------

    @property
    def api(self) -> KubeAPI:
        if self._api is None:
            raise RuntimeError("the cluster is not started")
        return self._api

    @property
    def bin_dir(self) -> Path:
        if self._bin_dir is None:
            self._bin_dir = ensure_binaries()
        return self._bin_dir

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        log.info(
            "local cluster ready in %.1fs: %d nodes x %d GPUs, kubeconfig %s",
            time.monotonic() - started,
            self.config.nodes,
            self.config.node_shape.gpus,
            self.kubeconfig,
        )

    def stop(self) -> None:
        """Stops the pod runner, then each component in reverse start order; safe to call more than once."""
        errors: list[str] = []
        if self.pod_runner is not None:
            try:
                self.pod_runner.stop()
            except Exception as error:
                errors.append(f"pod runner: {error}")
            self.pod_runner = None
        if self.network is not None:
            try:
                self.network.stop()
            except Exception as error:
                errors.append(f"service network: {error}")
            self.network = None
        while self._processes:
            process = self._processes.pop()
            try:
                process.stop()
            except Exception as error:
                errors.append(f"{process.name}: {error}")
        leftovers = self._ledger.stop_all()
        if leftovers:
            errors.append(f"stopped leftover processes: {', '.join(leftovers)}")
        shutil.rmtree(self.state_dir / "etcd-data", ignore_errors=True)
        while self._subnet_locks:
            self._subnet_locks.pop().close()
        self._api = None
        if errors:
            raise RuntimeError("stopping the local cluster: " + "; ".join(errors))

    # -- start-up ---------------------------------------------------------------------------------------

    def _start(self) -> None:
        """Each step waits for what the next one needs; start() stops whatever the steps before a failure
        started."""
        bin_dir = self.bin_dir  # builds on first use, before anything is started
        pki = self._prepare_state()
        etcd, etcd_url = self._start_etcd(bin_dir)
        self._start_apiserver(bin_dir, pki, etcd, etcd_url)
        # The controller manager, the scheduler and kwok start together, then each is waited for.
        launched = [
            self._launch_controller_manager(bin_dir, pki),
            self._launch_scheduler(bin_dir),
            self._launch_kwok(bin_dir),
        ]
        self._wait_healthy(launched)
        self._wait_for_default_service_account()
        self._create_nodes()
        if self.config.pod_runner:
            self._start_service_network()
            self._start_pod_runner(pki)
        self._write_state()

    def _prepare_state(self) -> ClusterPKI:
        """The state folder without a previous run's processes, the pod range, the PKI, the admin token and
        its kubeconfig."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        leftovers = self._ledger.stop_all()
        if leftovers:
            log.warning("stopped processes a previous run in %s left behind: %s", self.state_dir, leftovers)
        self.pod_cidr = self._claim_subnet()
        pki = make_pki(self.state_dir / "pki")
        self.token = secrets.token_hex(24)
        self._token_file.write_text(f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        self._token_file.chmod(0o600)
        self.server = f"https://127.0.0.1:{free_port()}"
        write_kubeconfig(self.kubeconfig, self.server, self.ca_cert, ADMIN_USER, self.token)
        return pki

    def _start_etcd(self, bin_dir: Path) -> tuple[ManagedProcess, str]:
        """etcd, once healthy, and its client URL."""
        client_port, peer_port = free_port(), free_port()
        url = f"http://127.0.0.1:{client_port}"
        etcd = self.launch("etcd", [
            str(bin_dir / "etcd"),
            "--name=default",
            f"--data-dir={self.state_dir / 'etcd-data'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",  # a throwaway test database: durability costs seconds per start
            "--log-level=warn",
        ])  # fmt: skip
        _wait_until("etcd healthy", lambda: _http_ok(f"{url}/health"), self.config.start_timeout, [etcd])
        return etcd, url

    def _start_apiserver(self, bin_dir: Path, pki: ClusterPKI, etcd: ManagedProcess, etcd_url: str) -> None:
        """kube-apiserver on self.server (token auth, RBAC), once ready, and the client of its API."""
        apiserver = self.launch("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={urllib.parse.urlsplit(self.server).port}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={self._token_file}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.service_account_public_key}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=true",
            # The kubernetes Service's endpoints would be 127.0.0.1, which Endpoints reject.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ])  # fmt: skip
        self._api = KubeAPI(self.server, self.token, str(pki.ca_cert))
        verified = ssl.create_default_context(cafile=str(pki.ca_cert))
        _wait_until(
            "kube-apiserver ready",
            lambda: _http_ok(f"{self.server}/readyz", verified, self.token),
            self.config.start_timeout,
            [etcd, apiserver],
        )

    def _launch_controller_manager(self, bin_dir: Path, pki: ClusterPKI) -> tuple[ManagedProcess, str]:
        """kube-controller-manager, and the URL that says it is healthy."""
        port = free_port()
        process = self.launch("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--kube-api-qps={self.config.kube_api_qps}",
            f"--kube-api-burst={self.config.kube_api_burst}",
            # Pod IPs are loopback addresses, which Endpoints and EndpointSlices reject: these controllers
            # would only retry failing writes and post a Warning per Service and attempt.
            f"--controllers=*,{','.join('-' + name for name in NO_ENDPOINT_CONTROLLERS)}",
            "--profiling=false",
        ])  # fmt: skip
        return process, f"https://127.0.0.1:{port}/healthz"

    def _launch_scheduler(self, bin_dir: Path) -> tuple[ManagedProcess, str]:
        """kube-scheduler, and the URL that says it is healthy."""
        port = free_port()
        config = self.state_dir / "scheduler.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {
                        "kubeconfig": str(self.kubeconfig),
                        "qps": self.config.kube_api_qps,
                        "burst": self.config.kube_api_burst,
                    },
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        process = self.launch("kube-scheduler", [
            str(bin_dir / "kube-scheduler"),
            f"--config={config}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
        ])  # fmt: skip
        return process, f"https://127.0.0.1:{port}/healthz"

    def _launch_kwok(self, bin_dir: Path) -> tuple[ManagedProcess, str]:
        """kwok, the kubelets of the fake nodes (it leaves the pods the runner runs to the runner), and the
        URL that says it is healthy."""
        port = free_port()
        config = self.state_dir / "kwok.yaml"
        image_pattern = self.config.runner_image_pattern if self.config.pod_runner else None
        config.write_text(yaml.safe_dump_all(kwok_stages(image_pattern), sort_keys=False))
        process = self.launch("kwok", [
            str(bin_dir / "kwok"),
            f"--config={config}",
            f"--kubeconfig={self.kubeconfig}",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_SELECTOR}",
            f"--cidr={self.pod_cidr}",
            "--node-ip=127.0.0.1",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{port}",
        ])  # fmt: skip
        return process, f"http://127.0.0.1:{port}/healthz"

    def _wait_healthy(self, launched: Sequence[tuple[ManagedProcess, str]]) -> None:
        # Their serving certificates are self-signed; only liveness of local processes is read here.
        unverified = ssl._create_unverified_context()
        for process, url in launched:
            _wait_until(
                f"{process.name} healthy",
                lambda url=url: _http_ok(url, unverified),
                self.config.start_timeout,
                [process],
            )

    def _wait_for_default_service_account(self) -> None:
        """Pods can only be created once the controller manager has made the namespace's default account."""
        _wait_until(
            "the default ServiceAccount",
            lambda: bool(self.api.get("/api/v1/namespaces/default/serviceaccounts/default")),
            self.config.start_timeout,
            self._processes,
        )

    def _start_service_network(self) -> None:
        """Cluster DNS and the Service proxy; their clients are the pods the runner runs (kwok's fake pods
        reach nothing)."""
        upstream = self.config.dns_upstream or host_nameserver()
        self.network = ServiceNetwork(self.api, self._claim_subnet(), CLUSTER_DOMAIN, upstream)
        self.network.start(self.config.start_timeout)

    def _start_pod_runner(self, pki: ClusterPKI) -> None:
        assert self.network is not None
        self.pod_runner = PodRunner(
            api=self.api,
            work_dir=self.state_dir / "pods",
            image_pattern=self.config.runner_image_pattern,
            server=self.server,
            ca_cert=pki.ca_cert,
            ledger=self._ledger,
            programs=self._runner_programs,
            container_images=self.config.container_images,
            dns=self.network.pod_dns,
        )
        self.pod_runner.start()

    def _claim_subnet(self) -> str:
        """A loopback range of this cluster's own until it stops."""
        subnet, lock = claim_loopback_subnet(default_cache_dir() / "clusters" / "subnets")
        self._subnet_locks.append(lock)
        return subnet

    def launch(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        """Starts a process that belongs with the cluster (log: logs/<name>.log). It is stopped by its PID in
        reverse start order (a process started after the control plane, before it), and a crashed run's
        leftover by the next start in this folder."""
        process = start_process(name, argv, self.log_dir / f"{name}.log", self._ledger, env=env)
        self._processes.append(process)
        log.info("started %s (pid %d)", name, process.pid)
        return process

    def _create_nodes(self) -> None:
        names = fake_node_names(self.config.nodes)
        for name in names:
            self.api.create("/api/v1/nodes", fake_node(name, self.config.node_shape))

        def all_ready() -> bool:
            nodes = self.api.get("/api/v1/nodes", labelSelector="type=kwok")["items"]
            ready = {
                node["metadata"]["name"]
                for node in nodes
                for condition in node.get("status", {}).get("conditions", [])
                if condition["type"] == "Ready" and condition["status"] == "True"
            }
            return ready >= set(names)

        _wait_until(f"{len(names)} fake nodes Ready", all_ready, self.config.start_timeout, self._processes)

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "pod_cidr": self.pod_cidr,
            "cluster_dns": self.network.dns_address if self.network else None,
            "bin_dir": str(self.bin_dir),
            "pids": {process.name: process.pid for process in self._processes},
        }
        (self.state_dir / "cluster.json").write_text(json.dumps(state, indent=1))


def describe(cluster: LocalCluster) -> dict[str, Any]:
    """What a person needs to use a running cluster."""
    return {
        "kubeconfig": str(cluster.kubeconfig),
        "server": cluster.server,
        "pod_cidr": cluster.pod_cidr,
        "cluster_dns": cluster.network.dns_address if cluster.network else None,
        "logs": str(cluster.log_dir),
        "binaries": str(cluster.bin_dir),
    }
