"""The cluster's DNS server, answering as the Kubernetes DNS specification says, over UDP and TCP port 53 of
an address of the cluster's own (dnslib handles the wire format and the sockets):

- `<service>.<namespace>.svc.<domain>` A: the Service's address (services.py) for a ClusterIP Service, the
  addresses of its endpoints for a headless one;
- `<hostname>.<service>.<namespace>.svc.<domain>` A: the IP of the endpoint pod of that headless Service
  whose spec.hostname and spec.subdomain say so (a StatefulSet's pods);
- any other name under the cluster domain: NXDOMAIN; a known name asked for another type: no answer;
- every name outside the cluster domain: forwarded to the host's own nameserver, as received.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from .services import ServiceTable

log = logging.getLogger("kvfleet.e2e.cluster_dns")

CLUSTER_DOMAIN = "cluster.local"
DNS_PORT = 53
# CoreDNS's default: clients see a Service's new endpoints within seconds.
TTL_SECONDS = 5
FORWARD_TIMEOUT_SECONDS = 5.0


def host_nameserver(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int]:
    """The first nameserver of the host's resolver configuration, where names outside the cluster go."""
    for line in resolv_conf.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            return fields[1], DNS_PORT
    raise RuntimeError(f"{resolv_conf} names no nameserver to forward names outside the cluster to")


class ClusterResolver(BaseResolver):
    def __init__(self, services: ServiceTable, domain: str, upstream: tuple[str, int]) -> None:
        self._services = services
        self._domain = tuple(domain.split("."))
        self._upstream = upstream

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        labels = tuple(label.decode().lower() for label in request.q.qname.label)
        if labels[len(labels) - len(self._domain) :] != self._domain:
            return self._forward(request, tcp=handler.protocol == "tcp")
        reply = request.reply()
        below = labels[: len(labels) - len(self._domain)]
        addresses = self._addresses(below[:-1]) if below[-1:] == ("svc",) else None
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=TTL_SECONDS))
        return reply

    def _addresses(self, labels: tuple[str, ...]) -> list[str] | None:
        """The A records of a name below svc.<domain> (labels before it), or None if it does not exist."""
        if len(labels) == 2:
            service = self._services.get(labels[1], labels[0])
            if service is None:
                return None
            if service.address is not None:
                return [service.address]
            return sorted({endpoint.ip for endpoint in service.endpoints})
        if len(labels) == 3:
            service = self._services.get(labels[2], labels[1])
            if service is None or service.address is not None:
                return None
            found = [endpoint.ip for endpoint in service.endpoints if endpoint.hostname == labels[0]]
            return found or None
        return None

    def _forward(self, request: DNSRecord, tcp: bool) -> DNSRecord:
        host, port = self._upstream
        try:
            return DNSRecord.parse(request.send(host, port, tcp=tcp, timeout=FORWARD_TIMEOUT_SECONDS))
        except (OSError, ValueError) as error:  # the nameserver is away or answered garbage
            log.warning("forwarding %s to %s:%d failed: %s", request.q.qname, host, port, error)
            reply = request.reply()
            reply.header.rcode = RCODE.SERVFAIL
            return reply


class _ErrorsToLog(DNSLogger):
    """dnslib's logger prints to stdout; only malformed queries are worth a line, in the cluster's log."""

    def __init__(self) -> None:
        super().__init__("error", prefix=False)

    def log_error(self, handler: Any, error: Exception) -> None:
        log.warning(
            "malformed DNS query from %s over %s: %s", handler.client_address[0], handler.protocol, error
        )


class ClusterDNS:
    """The DNS server on `address`, port 53, UDP and TCP, each served by a thread until stop()."""

    def __init__(self, services: ServiceTable, address: str, domain: str, upstream: tuple[str, int]) -> None:
        resolver = ClusterResolver(services, domain, upstream)
        self.address = address
        self._servers: list[DNSServer] = []
        try:
            for tcp in (False, True):
                self._servers.append(
                    DNSServer(resolver, address=address, port=DNS_PORT, tcp=tcp, logger=_ErrorsToLog())
                )
        except OSError:
            self.stop()
            raise

    def start(self) -> None:
        for server in self._servers:
            server.start_thread()

    def stop(self) -> None:
        for server in self._servers:
            if getattr(server, "thread", None) is not None:
                server.stop()
                server.thread.join(timeout=10)
            server.server.server_close()
        self._servers.clear()
