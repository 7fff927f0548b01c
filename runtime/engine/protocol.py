"""What the OpenAI service needs of an engine. Two engines provide it: AsyncLLM, the client of an EngineCore
process (`kvfleet serve`), and InProcessEngine, which steps an EngineCore in this process (`kvfleet
run-batch`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.messages import EngineInfo
    from kvfleet.runtime.engine.outputs import RequestOutput
    from kvfleet.runtime.engine.sequences import ResumedSequence
    from kvfleet.runtime.errors import EngineError
    from kvfleet.runtime.lora.request import LoRARequest
    from kvfleet.runtime.multimodal.inputs import MultiModalFeature
    from kvfleet.runtime.sampling_params import SamplingParams

T = TypeVar("T")


class EngineClient(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def info(self) -> EngineInfo | None:
        """The served model's facts (context length, vocabulary, device); None until it has loaded."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, once loaded; work that takes time goes through run_tokenizer."""

    @property
    def error(self) -> EngineError | None:
        """Why the engine cannot serve, once it cannot."""

    @property
    def startup_request_timeout(self) -> float | None:
        """How long a request may wait for the model to load."""

    async def wait_ready(self, timeout: float | None) -> None:
        """Returns once the engine can serve; raises the EngineError that keeps it from serving."""

    async def run_tokenizer(self, work: Callable[[Any], T]) -> T:
        """work(tokenizer), off the event loop."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout: float | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        cache_salt: str | None = None,
        resumed: dict[int, ResumedSequence] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's delta outputs until the finished one; raises an EngineError when it fails. Leaving
        the iteration early aborts the request. A continuation (`resumed`, by sequence index: what each
        sequence already delivered elsewhere) first yields that (RequestOutput.resumed)."""

    def abort(self, request_id: str, error: BaseException) -> None:
        """Stops a request from outside: its `generate` raises `error`."""

    def remove_lora(self, lora_int_id: int) -> None:
        """vLLM's: the engine drops the adapter's weights once the requests running with it end."""

    def reset_prefix_cache(self) -> None:
        """vLLM's: the engine forgets every cached prefix block (the device's and the host tier's); KV-cache
        event subscribers hear AllBlocksCleared."""
