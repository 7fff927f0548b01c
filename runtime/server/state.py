"""What one API server process knows: its settings, the engine, the metrics and whether it is draining."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.runtime.engine.async_llm import AsyncLLM
from kvfleet.runtime.metrics import ServerMetrics
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
    engine: AsyncLLM
    metrics: ServerMetrics
    draining: bool = False
    # HTTP requests on generation routes that have not finished sending their response.
    in_flight: int = 0

    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.engine.error is not None:
            return f"the engine has failed: {self.engine.error}"
        if self.draining:
            return "the server is draining"
        return "the model is loading"
