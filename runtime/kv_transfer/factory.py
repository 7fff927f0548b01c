"""Binds `kv_connector` by name to its two halves, once, when the engine is built."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfleet.runtime.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.kv_transfer.tcp_connector import TcpConnectorScheduler, TcpConnectorWorker

_CONNECTORS: dict[str, tuple[type[KVConnectorScheduler], type[KVConnectorWorker]]] = {
    "TcpConnector": (TcpConnectorScheduler, TcpConnectorWorker),
}
CONNECTOR_NAMES = tuple(_CONNECTORS)


def check_connector_name(name: str) -> None:
    if name not in _CONNECTORS:
        raise ValueError(
            f"kv_transfer_config.kv_connector {name!r} is not one of {', '.join(CONNECTOR_NAMES)}"
        )


def make_scheduler_connector(
    config: KVTransferConfig, block_size: int, clock: Callable[[], float] = time.monotonic
) -> KVConnectorScheduler:
    check_connector_name(config.kv_connector)
    return _CONNECTORS[config.kv_connector][0](config, block_size, clock)  # type: ignore[call-arg]


def make_worker_connector(config: KVTransferConfig) -> KVConnectorWorker:
    check_connector_name(config.kv_connector)
    return _CONNECTORS[config.kv_connector][1](config)  # type: ignore[call-arg]
