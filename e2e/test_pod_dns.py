"""A pod's resolver files as a kubelet writes them, and the process wrapper that shows them to the pod only:
run for real (as root, as the cluster runs), without a cluster."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from e2e.cluster.pod_dns import PodDNS
from e2e.cluster.services import endpoints_of

DNS = PodDNS("127.9.0.10", "cluster.local")


def _pod(name: str, namespace: str = "team", ip: str = "127.8.0.5", **spec: object) -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "db"}},
        "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}], **spec},
        "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_resolv_conf_names_the_cluster_dns_with_the_pods_search_domains() -> None:
    assert DNS.resolv_conf("team") == (
        "nameserver 127.9.0.10\n"
        "search team.svc.cluster.local svc.cluster.local cluster.local\n"
        "options ndots:5\n"
    )


def test_hosts_hold_the_pods_fqdn_when_it_has_a_subdomain() -> None:
    stateful = _pod("db-0", hostname="db-0", subdomain="db")
    assert DNS.hosts(stateful).splitlines()[-1] == "127.8.0.5\tdb-0.db.team.svc.cluster.local db-0"
    assert DNS.hosts(_pod("web-7f9c")).splitlines()[-1] == "127.8.0.5\tweb-7f9c"


def test_dns_policy_decides_whether_the_cluster_dns_applies() -> None:
    assert PodDNS.applies(_pod("a"))
    assert not PodDNS.applies(_pod("a", dnsPolicy="Default"))
    assert not PodDNS.applies(_pod("a", hostNetwork=True))
    assert PodDNS.applies(_pod("a", hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet"))


def test_endpoints_are_the_selected_ready_pods_with_their_hostnames() -> None:
    service = {"metadata": {"name": "db"}, "spec": {"selector": {"app": "db"}, "clusterIP": "None"}}
    unready = _pod("db-1", ip="127.8.0.6", hostname="db-1", subdomain="db")
    unready["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    terminating = _pod("db-2", ip="127.8.0.7")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    other = _pod("web", ip="127.8.0.8")
    other["metadata"]["labels"] = {"app": "web"}
    pods = {
        "db-0": _pod("db-0", hostname="db-0", subdomain="db"),
        "db-1": unready,
        "db-2": terminating,
        "web": other,
    }
    (endpoint,) = endpoints_of(service, pods)
    assert (endpoint.pod, endpoint.ip, endpoint.hostname) == ("db-0", "127.8.0.5", "db-0")
    assert dict(endpoint.container_ports) == {"http": 8000}
    publishing = {**service, "spec": {**service["spec"], "publishNotReadyAddresses": True}}
    assert [e.pod for e in endpoints_of(publishing, pods)] == ["db-0", "db-1"]
    assert endpoints_of({**service, "spec": {"clusterIP": "None"}}, pods) == ()  # no selector


def test_the_wrapped_process_sees_the_pods_files_and_hostname_under_its_own_pid(tmp_path: Path) -> None:
    pod = _pod("db-0", hostname="db-0", subdomain="db")
    host_resolv_conf, host_name = Path("/etc/resolv.conf").read_text(), socket.gethostname()
    script = 'echo "$$"; cat /etc/resolv.conf; getent hosts db-0.db.team.svc.cluster.local; hostname'
    argv = DNS.process_argv(pod, tmp_path, ["sh", "-c", script])
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    pid, *rest = output.splitlines()
    assert int(pid) == process.pid  # exec all the way: stopping this PID stops the container's command
    assert "\n".join(rest[:3]) + "\n" == DNS.resolv_conf("team")
    assert rest[3].split() == ["127.8.0.5", "db-0.db.team.svc.cluster.local", "db-0"]
    assert rest[4] == "db-0"
    # The host's own are untouched.
    assert (Path("/etc/resolv.conf").read_text(), socket.gethostname()) == (host_resolv_conf, host_name)
