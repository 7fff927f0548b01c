"""What one serving process knows: its settings, the engine, the metrics and whether it is draining."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.server.async_engine import AsyncLLMEngine
from kvfleet.runtime.server.priorities import DEFAULT_TIER, TIERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    default_priority: int = TIERS[DEFAULT_TIER]
    # Seconds; None = requests may run as long as they need.
    request_timeout: float | None = None
    drain_timeout: float = 30.0
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


@dataclass
class ServerState:
    settings: ServerSettings
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    # The front end's own tokenizer: the engine thread uses the engine's, and the two never share one.
    tokenizer: Any = None
    draining: bool = False
    # HTTP requests on generation routes that have not finished sending their response.
    in_flight: int = 0
    # Set once loading has ended, well or not (then `load_error` says why).
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    load_error: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.engine.ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.load_error is not None or not self.engine.alive:
            return "the engine has failed"
        if self.draining:
            return "the server is draining"
        return "the model is loading"
