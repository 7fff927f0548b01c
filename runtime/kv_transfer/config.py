"""`--kv-transfer-config`: vLLM's JSON object, parsed and checked once, unknown keys refused by name."""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvfleet.runtime.json_options import json_object
from kvfleet.runtime.multimodal.media_sources import IPNetwork

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVLoadFailurePolicy = Literal["recompute", "fail"]
_KEYS = {
    "kv_connector",
    "kv_role",
    "kv_ip",
    "kv_port",
    "engine_id",
    "kv_load_failure_policy",
    "kv_connector_extra_config",
}
_EXTRA_KEYS = {"hold_timeout_s", "load_timeout_s", "connect_timeout_s", "peer_networks"}
# Where prefill replicas of one fleet live: loopback and the private ranges.
DEFAULT_PEER_NETWORKS = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)


@dataclass(frozen=True)
class KVTransferConfig:
    """How this replica takes part in disaggregated prefill and decode."""

    kv_connector: str
    kv_role: KVRole
    # The address this replica advertises and its block server binds; port 0 takes a free one.
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str = ""
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    # A finished prefill's blocks wait this long for their pull, then go back to the pool.
    hold_timeout_s: float = 120.0
    # A pull that takes longer fails (and falls back to recompute).
    load_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    # The networks a decode call's remote_host must be in.
    peer_networks: tuple[IPNetwork, ...] = ()

    @property
    def is_producer(self) -> bool:
        """Whether this replica takes prefill calls (do_remote_decode) and serves their blocks."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Whether this replica takes decode calls (do_remote_prefill) and pulls their blocks."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        """From the JSON text of the flag or the dict of `LLM(kv_transfer_config=...)`; raises ValueError
        naming what is wrong."""
        value = json_object(value, "kv_transfer_config")
        _refuse_unknown(value, _KEYS, "kv_transfer_config")
        extra = value.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        _refuse_unknown(extra, _EXTRA_KEYS, "kv_transfer_config.kv_connector_extra_config")
        connector = value.get("kv_connector")
        if not isinstance(connector, str) or not connector:
            raise ValueError("kv_transfer_config.kv_connector must name a connector, e.g. TcpConnector")
        role = _choice(value, "kv_role", get_args(KVRole), None)
        policy = _choice(value, "kv_load_failure_policy", get_args(KVLoadFailurePolicy), "recompute")
        kv_ip = value.get("kv_ip", "127.0.0.1")
        try:
            ipaddress.ip_address(kv_ip)
        except ValueError:
            raise ValueError(f"kv_transfer_config.kv_ip must be an IP address, got {kv_ip!r}") from None
        kv_port = value.get("kv_port", cls.kv_port)
        if not isinstance(kv_port, int) or isinstance(kv_port, bool) or not 0 <= kv_port < 65536:
            raise ValueError(
                f"kv_transfer_config.kv_port must be a TCP port (0: any free one), got {kv_port!r}"
            )
        engine_id = value.get("engine_id") or uuid.uuid4().hex
        if not isinstance(engine_id, str):
            raise ValueError(f"kv_transfer_config.engine_id must be a string, got {engine_id!r}")
        return cls(
            kv_connector=connector,
            kv_role=role,  # type: ignore[arg-type]
            kv_ip=kv_ip,
            kv_port=kv_port,
            engine_id=engine_id,
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            hold_timeout_s=_positive_seconds(extra, "hold_timeout_s", cls.hold_timeout_s),
            load_timeout_s=_positive_seconds(extra, "load_timeout_s", cls.load_timeout_s),
            connect_timeout_s=_positive_seconds(extra, "connect_timeout_s", cls.connect_timeout_s),
            peer_networks=_networks(extra.get("peer_networks", DEFAULT_PEER_NETWORKS)),
        )


def _refuse_unknown(value: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{where} does not take {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def _choice(value: dict[str, Any], key: str, allowed: tuple[str, ...], default: str | None) -> str:
    chosen = value.get(key, default)
    if chosen not in allowed:
        raise ValueError(f"kv_transfer_config.{key} must be one of {', '.join(allowed)}, got {chosen!r}")
    return chosen


def _positive_seconds(extra: dict[str, Any], key: str, default: float) -> float:
    seconds = extra.get(key, default)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} must be positive seconds")
    return float(seconds)


def _networks(entries: Any) -> tuple[IPNetwork, ...]:
    if not isinstance(entries, list | tuple) or not all(isinstance(entry, str) for entry in entries):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.peer_networks must be a list of CIDRs")
    try:
        return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)
    except ValueError as error:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.peer_networks: {error}") from None
