"""Where media URLs may be fetched from: the origins (scheme, host and port) --allowed-media-domains lists,
and the addresses their names may resolve to (public ones, and the networks --allowed-media-networks
lists), so that an allowed name cannot reach the server's own network, loopback or a cloud metadata
address."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class MediaOrigin:
    """One entry of allowed_media_domains: `host`, `host:port` or `scheme://host[:port]`. Without a scheme
    it allows http and https; without a port, only the scheme's default one (80, 443)."""

    host: str
    port: int | None
    scheme: str | None

    @classmethod
    def parse(cls, entry: str) -> MediaOrigin:
        scheme, separator, rest = entry.partition("://")
        if not separator:
            scheme, rest = "", entry
        scheme = scheme.lower()
        problem = f"allowed_media_domains: {entry!r} is not host, host:port or http(s)://host[:port]"
        if scheme not in ("", *DEFAULT_PORTS):
            raise ValueError(problem)
        parts = urlsplit(f"//{rest}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(problem) from None
        if not parts.hostname or parts.path or parts.query or parts.fragment or "@" in parts.netloc:
            raise ValueError(problem)
        return cls(parts.hostname, port, scheme or None)

    def allows(self, scheme: str, host: str, port: int) -> bool:
        """Whether a URL of this scheme, host (lower case) and port (the scheme's default when the URL names
        none) is of this origin."""
        return (
            host == self.host
            and self.scheme in (None, scheme)
            and port == (self.port if self.port is not None else DEFAULT_PORTS[scheme])
        )


def parse_origins(text: str | None) -> tuple[MediaOrigin, ...]:
    """The origins of a comma-separated allowed_media_domains."""
    return tuple(MediaOrigin.parse(entry) for entry in _entries(text))


def parse_networks(text: str | None) -> tuple[IPNetwork, ...]:
    """The networks of a comma-separated allowed_media_networks (CIDRs or single addresses)."""
    networks = []
    for entry in _entries(text):
        try:
            networks.append(ipaddress.ip_network(entry))
        except ValueError as exc:
            raise ValueError(f"allowed_media_networks: {exc}") from None
    return tuple(networks)


def address_allowed(address: IPAddress, networks: Iterable[IPNetwork]) -> bool:
    """Whether media may be fetched from this address: a public one, or one of the allowed networks."""
    return address.is_global or any(address in network for network in networks)


def _entries(text: str | None) -> list[str]:
    return [entry.strip() for entry in (text or "").replace(" ", ",").split(",") if entry.strip()]
