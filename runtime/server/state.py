"""What one API server process knows: its settings, the engine, the metrics and whether it is draining."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet.runtime.batch.store import (
    DEFAULT_MAX_BATCH_FILE_BYTES,
    DEFAULT_MAX_BATCH_FILES,
    DEFAULT_MAX_BATCH_STORE_BYTES,
)
from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.serving.service import OpenAIService, ServiceSettings

if TYPE_CHECKING:
    # The engine client brings Transformers: `kvfleet serve` checks its options and the model folder first.
    from kvfleet.runtime.engine.async_llm import AsyncLLM

    # Checking adapters loads torch: API servers import it only with --enable-lora.
    from kvfleet.runtime.safety.config import SafetyConfig
    from kvfleet.runtime.serving.lora_adapters import LoRAAdapters
    from kvfleet.runtime.serving.safety import ServerGuardrails

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_HEADER_READ_TIMEOUT_S = 30.0
# h11's own bound on a request's headers, which kvfleet keeps (vLLM raises it to 4 MiB), and vLLM's count.
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024
DEFAULT_H11_MAX_HEADER_COUNT = 256
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_SEND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerSettings(ServiceSettings):
    """The OpenAI service's settings and the HTTP server's own."""

    api_key: str | None = None
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Seconds a connection has to send a request's headers (from its opening, or the previous response),
    # the whole body, and how long a response may wait on a client that has stopped reading.
    header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT_S
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT_S
    send_timeout: float = DEFAULT_SEND_TIMEOUT_S
    # vLLM's: the most bytes of a request's headers buffered before they are whole (h11's incomplete event;
    # 400 past it), and the most headers (431 past it).
    h11_max_incomplete_event_size: int = DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE
    h11_max_header_count: int = DEFAULT_H11_MAX_HEADER_COUNT
    # vLLM's: seconds a chat or completion stream may stay quiet before it carries a keep-alive comment
    # (opening first if it has not yet); 0 for none.
    sse_keep_alive_interval: float = 0.0
    # The Batch API's folder (its database and files); None: no /v1/files or /v1/batches.
    batch_store: str | None = None
    max_batch_file_bytes: int = DEFAULT_MAX_BATCH_FILE_BYTES
    max_batch_files: int = DEFAULT_MAX_BATCH_FILES
    max_batch_store_bytes: int = DEFAULT_MAX_BATCH_STORE_BYTES
    # Input and output guardrails (docs/safety.md); None: none.
    safety: SafetyConfig | None = None
    # CORS, as vLLM's flags have it: browsers may call the API from any origin unless told otherwise.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # The prefix a path-routing proxy serves the API under (FastAPI's root_path); "" for none.
    root_path: str = ""
    # vLLM's: no /openapi.json (the API's schema).
    disable_fastapi_docs: bool = False
    # vLLM's: every response carries X-Request-Id (the request's own, or a new one).
    enable_request_id_headers: bool = False
    # vLLM's: GET /load answers the requests in flight.
    enable_server_load_tracking: bool = False
    # vLLM's: GET /tokenizer_info answers the tokenizer's configuration.
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's: every error answered is logged with its stack.
    log_error_stack: bool = False
    # vLLM's: where each request's span goes over OTLP (kvfleet.runtime.tracing); None: no traces.
    otlp_traces_endpoint: str | None = None
    # The most responses (/v1/responses) kept in memory for previous_response_id and retrieval; 0: none
    # are kept, as vLLM serves by default.
    max_stored_responses: int = 0


@dataclass
class ServerState:
    settings: ServerSettings
    engine: AsyncLLM
    metrics: ServerMetrics
    draining: bool = False
    # HTTP requests on generation routes that have not finished sending their response.
    in_flight: int = 0
    # The LoRA adapters served by name; None when LoRA is off.
    lora_adapters: LoRAAdapters | None = None
    # The checkers of settings.safety; None without it.
    guardrails: ServerGuardrails | None = None
    # Why the Batch API's worker has stopped (its store broken), once it has: only a restart mends that.
    batch_worker_failure: str | None = None

    @property
    def ready(self) -> bool:
        return (
            self.engine.ready
            and not self.engine.is_sleeping
            and not self.draining
            and self.batch_worker_failure is None
        )

    @property
    def failure(self) -> str | None:
        """Why this server can no longer do its work, if it cannot."""
        if self.engine.error is not None:
            return f"the engine has failed: {self.engine.error}"
        return self.batch_worker_failure

    def openai_service(self) -> OpenAIService:
        """The OpenAI service over this server's engine, refusing new requests while the server drains."""
        return OpenAIService(
            self.engine,
            self.settings,
            metrics=self.metrics,
            lora_adapters=self.lora_adapters,
            guardrails=self.guardrails,
            refusal=lambda: self.not_ready_reason() if self.draining else None,
        )

    def not_ready_reason(self) -> str:
        if self.failure is not None:
            return self.failure
        if self.draining:
            return "the server is draining"
        if self.engine.is_sleeping:
            return "the engine is asleep"
        return "the model is loading"
