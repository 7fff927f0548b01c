"""Cluster DNS and Service routing on the local cluster, seen from inside pods (their own resolver, through
support/probe_target.py) and on the wire (dnslib queries to the cluster's DNS server).

The cluster here forwards names outside the cluster domain to a nameserver of the test's own, so what a
pod gets for such a name is known; Service addresses and pod IPs are checked against the API server's
objects.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from e2e.cluster import ClusterConfig, LocalCluster
from e2e.cluster.cluster import free_port
from e2e.conftest import fresh_namespace
from e2e.support.waits import wait_for
from e2e.test_pod_runner import PORT, http_json, is_ready, pod_path, ready_pod, target_pod

DOMAIN = "cluster.local"
# A name only the test's upstream nameserver knows, and the address it gives (TEST-NET-1).
OUTSIDE_NAME = "upstream-only.kvfleet-e2e.test"
OUTSIDE_ADDRESS = "192.0.2.7"
SERVICE_PORT = 80


class OneNameResolver(BaseResolver):
    """The upstream: OUTSIDE_NAME's address, NXDOMAIN for anything else."""

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        if str(request.q.qname).rstrip(".") == OUTSIDE_NAME and request.q.qtype == QTYPE.A:
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(OUTSIDE_ADDRESS), ttl=60))
        elif str(request.q.qname).rstrip(".") != OUTSIDE_NAME:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, int]]:
    port = free_port()
    servers = [
        DNSServer(
            OneNameResolver(),
            address="127.0.0.1",
            port=port,
            tcp=tcp,
            logger=DNSLogger("error", prefix=False),
        )
        for tcp in (False, True)
    ]
    for server in servers:
        server.start_thread()
    yield "127.0.0.1", port
    for server in servers:
        server.stop()
        server.server.server_close()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    cluster_bin_dir: Path,
    probe_target_program: str,
    upstream: tuple[str, int],
) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("networked-cluster"),
        ClusterConfig(nodes=1, dns_upstream=upstream),
        bin_dir=cluster_bin_dir,
        runner_programs={"probe-target": probe_target_program},
    )
    # Another cluster (the session's) may run its own network threads beside this one's.
    running_before = set(threading.enumerate())
    with cluster:
        assert cluster.network is not None
        dns_address = cluster.network.dns_address
        yield cluster
    # Stopped with the cluster: the DNS server's sockets, and every watch, proxy and DNS thread.
    leftovers = [
        t.name
        for t in set(threading.enumerate()) - running_before
        if t.name.startswith(("watch-", "service-proxy"))
    ]
    assert not leftovers, f"threads left running: {leftovers}"
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(type=kind) as probe:
            if kind == socket.SOCK_STREAM:  # past the TIME_WAIT of the TCP queries, as a listener binds
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((dns_address, 53))  # fails while the DNS server holds the port


@dataclass(frozen=True)
class Workloads:
    namespace: str
    client_ip: str


def _service(name: str, selector: dict[str, str], headless: bool = False, port: int = SERVICE_PORT) -> dict:
    spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": "http", "port": port, "targetPort": "http"}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def _labelled(pod: dict, labels: dict[str, str]) -> dict:
    pod["metadata"]["labels"] = labels
    return pod


@pytest.fixture(scope="module")
def workloads(cluster: LocalCluster) -> Iterator[Workloads]:
    """Pods web-a and web-b behind the ClusterIP Service `web` and the headless `peers`, the StatefulSet `db`
    (one replica) behind its headless Service `db`, and a pod `client` to ask from."""
    api = cluster.api
    with fresh_namespace(cluster, "cluster-network") as namespace:
        pods = f"/api/v1/namespaces/{namespace}/pods"
        services = f"/api/v1/namespaces/{namespace}/services"
        for name in ("web-a", "web-b"):
            api.create(pods, _labelled(target_pod(name), {"app": "web"}))
        api.create(pods, target_pod("client"))
        api.create(services, _service("web", {"app": "web"}))
        api.create(services, _service("peers", {"app": "web"}, headless=True))
        api.create(services, _service("db", {"app": "db"}, headless=True, port=PORT))
        template = _labelled(target_pod("unused"), {"app": "db"})
        del template["metadata"]["name"]
        statefulset = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "db"},
            "spec": {
                "serviceName": "db",
                "replicas": 1,
                "selector": {"matchLabels": {"app": "db"}},
                "template": template,
            },
        }
        api.create(f"/apis/apps/v1/namespaces/{namespace}/statefulsets", statefulset)
        try:
            for name in ("web-a", "web-b", "db-0"):
                ready_pod(cluster, namespace, name)
            client = ready_pod(cluster, namespace, "client")
            yield Workloads(namespace, client["status"]["podIP"])
        finally:  # before the namespace's pods go, or it would make db-0 again
            api.delete(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/db")


def _pod_ip(cluster: LocalCluster, namespace: str, name: str) -> str:
    return cluster.api.get(pod_path(namespace, name))["status"]["podIP"]


def _from_pod(pod_ip: str, path: str, **query: str) -> dict[str, Any]:
    return http_json(f"http://{pod_ip}:{PORT}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else ""))


def _resolved(pod_ip: str, name: str) -> list[str] | None:
    """The addresses name resolves to inside the pod; None when its resolver found none."""
    return _from_pod(pod_ip, "/resolve", name=name).get("addresses")


def _answer(cluster: LocalCluster, name: str, tcp: bool = False) -> tuple[int, list[str]]:
    """(rcode, A records) from the cluster's DNS server, asked directly."""
    assert cluster.network is not None
    packet = DNSRecord.question(name, "A").send(cluster.network.dns_address, 53, tcp=tcp, timeout=5)
    reply = DNSRecord.parse(packet)
    return reply.header.rcode, sorted(str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A)


def _served_by(client_ip: str, url: str) -> str | None:
    """The pod whose process answered GET url from the client pod (None: the connection failed)."""
    fetched = _from_pod(client_ip, "/fetch", url=url)
    if "error" in fetched:
        return None
    return json.loads(fetched["body"])["env"]["HOSTNAME"]


def test_pods_resolve_services_headless_services_and_statefulset_pods(
    cluster: LocalCluster, workloads: Workloads
) -> None:
    namespace, client = workloads.namespace, workloads.client_ip
    assert cluster.network is not None
    rcode, (address,) = _answer(cluster, f"web.{namespace}.svc.{DOMAIN}")
    assert rcode == RCODE.NOERROR
    service_range = ipaddress.ip_network(cluster.network.subnet)
    assert ipaddress.ip_address(address) in service_range
    assert not service_range.overlaps(ipaddress.ip_network(cluster.pod_cidr))
    # The search domains make the short forms work from the Service's namespace.
    for name in ("web", f"web.{namespace}", f"web.{namespace}.svc", f"web.{namespace}.svc.{DOMAIN}"):
        assert _resolved(client, name) == [address], name

    web_ips = sorted(_pod_ip(cluster, namespace, name) for name in ("web-a", "web-b"))
    assert _resolved(client, "peers") == web_ips
    assert _answer(cluster, f"peers.{namespace}.svc.{DOMAIN}", tcp=True) == (RCODE.NOERROR, web_ips)

    db_ip = _pod_ip(cluster, namespace, "db-0")
    assert _resolved(client, f"db-0.db.{namespace}.svc.{DOMAIN}") == [db_ip]
    assert _resolved(client, "db-0.db") == [db_ip]
    # The pod's own hostname and FQDN, as a kubelet sets them, from its /etc/hosts.
    db_info = _from_pod(db_ip, "/info")
    assert db_info["hostname"] == "db-0"
    assert _resolved(db_ip, f"db-0.db.{namespace}.svc.{DOMAIN}") == [db_ip]

    assert _resolved(client, "no-such-service") is None
    assert _answer(cluster, f"no-such-service.{namespace}.svc.{DOMAIN}") == (RCODE.NXDOMAIN, [])
    assert _answer(cluster, f"nobody.web.{namespace}.svc.{DOMAIN}") == (RCODE.NXDOMAIN, [])


def test_names_outside_the_cluster_go_to_the_upstream_nameserver(
    cluster: LocalCluster, workloads: Workloads
) -> None:
    assert _resolved(workloads.client_ip, OUTSIDE_NAME) == [OUTSIDE_ADDRESS]
    assert _answer(cluster, OUTSIDE_NAME, tcp=True) == (RCODE.NOERROR, [OUTSIDE_ADDRESS])
    assert _resolved(workloads.client_ip, "elsewhere.kvfleet-e2e.test") is None
    assert _resolved(workloads.client_ip, "localhost") == ["127.0.0.1"]


def test_http_through_a_service_reaches_its_ready_endpoints_only(
    cluster: LocalCluster, workloads: Workloads
) -> None:
    api, namespace, client = cluster.api, workloads.namespace, workloads.client_ip
    url = f"http://web.{namespace}.svc/info"
    # Round robin over the two ready endpoints.
    assert {_served_by(client, url) for _ in range(4)} == {"web-a", "web-b"}

    web_a = _pod_ip(cluster, namespace, "web-a")
    http_json(f"http://{web_a}:{PORT}/unready", method="POST")
    wait_for("web-a not Ready", lambda: not is_ready(api.get(pod_path(namespace, "web-a"))))
    wait_for(
        "web-a out of the peers", lambda: _resolved(client, "peers") == [_pod_ip(cluster, namespace, "web-b")]
    )
    assert {_served_by(client, url) for _ in range(4)} == {"web-b"}

    api.delete(pod_path(namespace, "web-b"))
    # No ready endpoint left: the connection is closed, nothing answers.
    wait_for("web-b out of the peers", lambda: _resolved(client, "peers") is None)
    assert _served_by(client, url) is None

    http_json(f"http://{web_a}:{PORT}/ready", method="POST")
    wait_for("web-a Ready again", lambda: is_ready(api.get(pod_path(namespace, "web-a"))))
    wait_for("web-a back in the peers", lambda: _resolved(client, "peers") == [web_a])
    assert {_served_by(client, url) for _ in range(4)} == {"web-a"}


def test_a_server_sent_event_stream_passes_the_proxy_as_it_comes(
    cluster: LocalCluster, workloads: Workloads
) -> None:
    """The stream's second event is held back until released: the first must arrive before that."""
    namespace = workloads.namespace
    _, (address,) = _answer(cluster, f"web.{namespace}.svc.{DOMAIN}")
    _, endpoints = _answer(cluster, f"peers.{namespace}.svc.{DOMAIN}")
    connection = http.client.HTTPConnection(address, SERVICE_PORT, timeout=30)
    try:
        connection.request("GET", "/stream")
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline() == b"data: first\n"
        for endpoint in endpoints:  # whichever of them serves the stream
            http_json(f"http://{endpoint}:{PORT}/release-stream", method="POST")
        assert response.read() == b"\ndata: second\n\n"
    finally:
        connection.close()


def test_a_deleted_service_gives_up_its_name_and_address(cluster: LocalCluster, workloads: Workloads) -> None:
    namespace = workloads.namespace
    name = f"web.{namespace}.svc.{DOMAIN}"
    _, (address,) = _answer(cluster, name)
    cluster.api.delete(f"/api/v1/namespaces/{namespace}/services/web")
    wait_for("the Service's name gone", lambda: _answer(cluster, name)[0] == RCODE.NXDOMAIN)

    def refused() -> bool:
        try:
            with socket.create_connection((address, SERVICE_PORT), timeout=5):
                return False
        except ConnectionRefusedError:
            return True

    wait_for("nothing listening on the Service's address", refused)
