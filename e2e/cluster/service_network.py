"""Cluster DNS and Service routing for the local cluster: what CoreDNS and kube-proxy do on a real one.

A loopback range of the cluster's own (apart from the pod range) holds the DNS server's address and the
Service addresses that stand in for ClusterIPs; the Service table (services.py) follows the API server, the
proxy (service_proxy.py) listens on each ClusterIP Service's address and ports, and the DNS server
(cluster_dns.py) answers for Services and pods. Pods are pointed at it by the pod runner (pod_dns.py).
"""

from __future__ import annotations

import ipaddress

from .cluster_dns import ClusterDNS
from .kube_api import KubeAPI
from .pod_dns import PodDNS
from .service_proxy import ServiceProxy
from .services import LoopbackAddresses, ServiceTable

# The DNS server's host number in the range, as kube-dns takes the tenth address of the Service range.
DNS_HOST_NUMBER = 10


class ServiceNetwork:
    def __init__(self, api: KubeAPI, subnet: str, domain: str, upstream: tuple[str, int]) -> None:
        self.subnet = subnet
        self.dns_address = str(ipaddress.ip_network(subnet).network_address + DNS_HOST_NUMBER)
        self.pod_dns = PodDNS(self.dns_address, domain)
        self._domain = domain
        self._upstream = upstream
        self._proxy = ServiceProxy(lambda key: self.services.get(*key))
        addresses = LoopbackAddresses(subnet, reserved=frozenset({self.dns_address}))
        self.services = ServiceTable(api, addresses, self._proxy.update)
        self._dns: ClusterDNS | None = None

    def start(self, timeout: float) -> None:
        """Serves once the first lists of Services and pods are in; stop() undoes a partial start."""
        self._proxy.start()
        self.services.start(timeout)
        self._dns = ClusterDNS(self.services, self.dns_address, self._domain, self._upstream)
        self._dns.start()

    def stop(self) -> None:
        """Stops answering, watching and relaying (each thread joined); safe to call more than once."""
        try:
            if self._dns is not None:
                self._dns.stop()
                self._dns = None
            self.services.stop()
        finally:
            self._proxy.stop()
