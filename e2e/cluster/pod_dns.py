"""A pod's resolver configuration, as a kubelet writes it for dnsPolicy ClusterFirst: /etc/resolv.conf naming
the cluster's DNS server with the pod's search domains, and /etc/hosts with localhost and the pod's own
name and IP.

A pod's process sees them through a mount namespace of its own, where the files the runner wrote into the
pod's folder are bind-mounted over /etc/resolv.conf and /etc/hosts (the host's own files are never
touched), and a UTS namespace holding the pod's hostname. The wrapper execs the container's command, so the
process keeps the PID it was started with. A container run with podman gets the same through podman's
options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NDOTS = 5
# In the new mount namespace (unshare makes its mounts private): the pod's files over the host's, the pod's
# hostname, then the container's command in place of this shell.
_ENTER_POD_NETWORK = (
    'mount --bind "$1" /etc/resolv.conf && mount --bind "$2" /etc/hosts && '
    'echo "$3" > /proc/sys/kernel/hostname && shift 3 && exec "$@"'
)


@dataclass(frozen=True)
class PodDNS:
    """The cluster's DNS server and domain, as each pod's resolver is told them."""

    nameserver: str
    domain: str

    @staticmethod
    def applies(pod: Mapping[str, Any]) -> bool:
        """Whether the pod's dnsPolicy sends it to the cluster DNS (a host-network pod only with
        ClusterFirstWithHostNet). Otherwise the pod keeps the host's resolver, which is what Default means;
        None's spec.dnsConfig is not applied."""
        policy = pod["spec"].get("dnsPolicy", "ClusterFirst")
        host_network = bool(pod["spec"].get("hostNetwork"))
        return policy == "ClusterFirstWithHostNet" or (policy == "ClusterFirst" and not host_network)

    def search(self, namespace: str) -> list[str]:
        return [f"{namespace}.svc.{self.domain}", f"svc.{self.domain}", self.domain]

    def resolv_conf(self, namespace: str) -> str:
        return (
            f"nameserver {self.nameserver}\n"
            f"search {' '.join(self.search(namespace))}\n"
            f"options ndots:{NDOTS}\n"
        )

    def hostnames(self, pod: Mapping[str, Any]) -> list[str]:
        """The pod's hostname (spec.hostname, else its name), after its FQDN when it has a subdomain."""
        meta, spec = pod["metadata"], pod["spec"]
        hostname = spec.get("hostname") or meta["name"][:63]
        subdomain = spec.get("subdomain")
        if subdomain:
            return [f"{hostname}.{subdomain}.{meta['namespace']}.svc.{self.domain}", hostname]
        return [hostname]

    def hosts(self, pod: Mapping[str, Any]) -> str:
        return (
            "# Kubernetes-managed hosts file.\n"
            "127.0.0.1\tlocalhost\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{pod['status']['podIP']}\t{' '.join(self.hostnames(pod))}\n"
        )

    def process_argv(self, pod: Mapping[str, Any], pod_dir: Path, argv: Sequence[str]) -> list[str]:
        """argv run in the pod's own view of /etc/resolv.conf, /etc/hosts and its hostname; writes the files
        into pod_dir."""
        resolv_conf, hosts = pod_dir / "resolv.conf", pod_dir / "hosts"
        resolv_conf.write_text(self.resolv_conf(pod["metadata"]["namespace"]))
        hosts.write_text(self.hosts(pod))
        hostname = self.hostnames(pod)[-1]
        return [
            "unshare", "--mount", "--uts", "--", "sh", "-c", _ENTER_POD_NETWORK, "pod-network",
            str(resolv_conf), str(hosts), hostname, *argv,
        ]  # fmt: skip

    def podman_options(self, pod: Mapping[str, Any]) -> list[str]:
        """The same for `podman run`: podman writes the container's resolv.conf and hosts itself."""
        names = self.hostnames(pod)
        options = ["--dns", self.nameserver, "--dns-option", f"ndots:{NDOTS}", "--hostname", names[-1]]
        for domain in self.search(pod["metadata"]["namespace"]):
            options += ["--dns-search", domain]
        for name in names:
            options += ["--add-host", f"{name}:{pod['status']['podIP']}"]
        return options
