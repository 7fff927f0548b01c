"""`--kv-events-config`: vLLM's JSON object, parsed and checked once, unknown keys refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvfleet.contract.kv_events import DEFAULT_EVENTS_PORT, ENCODINGS, Encoding
from kvfleet.runtime.json_options import json_object

PublisherName = Literal["null", "zmq"]
_NAME = "kv_events_config"
_KEYS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
    "encoding",
}


@dataclass(frozen=True)
class KVEventsConfig:
    """Whether and where this replica publishes what its prefix cache holds (kvfleet.contract.kv_events)."""

    enable_kv_cache_events: bool = False
    publisher: PublisherName = "null"
    # A ZeroMQ endpoint: one with a wildcard host (tcp://*:5557), or an ipc:// or inproc:// one, is bound;
    # any other is connected to (a collector that binds and gathers several replicas' events).
    endpoint: str = f"tcp://*:{DEFAULT_EVENTS_PORT}"
    # Where subscribers ask for the batches they missed; always bound. None: no replay.
    replay_endpoint: str | None = None
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # The PUB socket's send high-water mark, in messages: past it a slow subscriber's messages are dropped.
    hwm: int = 100_000
    # Batches waiting for the publisher thread; past it the oldest is dropped.
    max_queue_size: int = 100_000
    topic: str = ""
    # kvfleet's: how events are encoded, as recent vLLM does (maps, which its own decoder requires) or as
    # earlier vLLM did (arrays, which the subscriber example it published then reads).
    encoding: Encoding = "map"

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> KVEventsConfig:
        """From the JSON text of the flag or the dict of `LLM(kv_events_config=...)`; raises ValueError naming
        what is wrong."""
        value = json_object(value, _NAME)
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"{_NAME} does not take {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})"
            )
        enabled = value.get("enable_kv_cache_events", False)
        if not isinstance(enabled, bool):
            raise ValueError(f"{_NAME}.enable_kv_cache_events must be true or false, got {enabled!r}")
        publisher = value.get("publisher", "zmq" if enabled else "null")
        if publisher not in get_args(PublisherName):
            raise ValueError(f"{_NAME}.publisher must be one of null, zmq, got {publisher!r}")
        replay_endpoint = value.get("replay_endpoint")
        if replay_endpoint is not None:
            replay_endpoint = _endpoint(replay_endpoint, "replay_endpoint")
        topic = value.get("topic", cls.topic)
        if not isinstance(topic, str):
            raise ValueError(f"{_NAME}.topic must be a string, got {topic!r}")
        encoding = value.get("encoding", cls.encoding)
        if encoding not in ENCODINGS:
            raise ValueError(f"{_NAME}.encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        return cls(
            enable_kv_cache_events=enabled,
            publisher=publisher,
            endpoint=_endpoint(value.get("endpoint", cls.endpoint), "endpoint"),
            replay_endpoint=replay_endpoint,
            buffer_steps=_positive(value, "buffer_steps", cls.buffer_steps),
            hwm=_positive(value, "hwm", cls.hwm),
            max_queue_size=_positive(value, "max_queue_size", cls.max_queue_size),
            topic=topic,
            encoding=encoding,
        )


def binds(endpoint: str) -> bool:
    """Whether a socket binds `endpoint` rather than connecting to it (vLLM's rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _endpoint(endpoint: Any, key: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(
            f"{_NAME}.{key} must be a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME), "
            f"got {endpoint!r}"
        )
    return endpoint


def _positive(value: dict[str, Any], key: str, default: int) -> int:
    number = value.get(key, default)
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"{_NAME}.{key} must be a positive integer, got {number!r}")
    return number
