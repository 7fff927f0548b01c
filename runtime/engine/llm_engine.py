"""The offline engine: tokenizer, EngineCore and output processing in one process, stepped by the caller.

The offline `LLM` drives this loop; the server runs the EngineCore in its own process instead (see
core_proc.py and async_llm.py) and does the tokenizer's and output processor's work in the API server.
"""

from __future__ import annotations

import logging
import time

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import EngineCoreOutput, SchedulerStats
from kvfleet.runtime.engine.core import EngineCore
from kvfleet.runtime.engine.output_processor import OutputProcessor
from kvfleet.runtime.engine.outputs import OutputKind, RequestOutput
from kvfleet.runtime.engine.sequences import ResumedSequence, sequence_ids, sequence_requests
from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.generation_config import other_end_token_ids
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.multimodal.prompt_media import PromptMedia
from kvfleet.runtime.request import FinishReason
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.engine_core = EngineCore(config)
        self.runner = self.engine_core.executor.runner
        self.max_model_len: int = self.engine_core.max_model_len
        self.vocab_size: int = self.engine_core.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.other_end_token_ids = other_end_token_ids(
            self.config.generation_config, self.config.model, self.eos_token_id
        )
        self.prompt_media = PromptMedia.for_model(
            config.model, config.mm_limits(), config.max_audio_clip_s, config.hf_overrides
        )

    @property
    def num_steps(self) -> int:
        return self.engine_core.num_steps

    # ---- requests -------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError (a ValueError) for input the engine cannot serve."""
        self.engine_core.validate_prompt(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout: float | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        cache_salt: str | None = None,
        resumed: dict[int, ResumedSequence] | None = None,
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises ValueError on bad input.

        `prompt_token_ids`, when the caller has already tokenized (and validated) a text prompt, saves doing
        it twice; with images or audio clips, they are the expanded ones that PromptMedia.prepare gave
        with `mm_features`.
        """
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be positive")
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize(prompt)
            self.validate_prompt(prompt_token_ids, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_processor.add_request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_token_ids,
            params,
            output_kind,
            sequence_ids(request_id, params.n),
            arrival_time,
            resumed,
        )
        for add in sequence_requests(
            request_id,
            prompt_token_ids,
            params,
            eos_token_id=self.eos_token_id,
            other_end_token_ids=self.other_end_token_ids,
            arrival_time=arrival_time,
            priority=priority,
            timeout=timeout,
            lora_request=lora_request,
            mm_features=mm_features,
            cache_salt=cache_salt,
            resumed=resumed,
        ):
            self.engine_core.add_request(add)
        return prompt_token_ids

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their KV blocks are freed at once. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        self.engine_core.abort_requests(
            [sid for rid in ids for sid in self.output_processor.sequence_ids(rid)]
        )
        for rid in ids:
            self.output_processor.remove(rid)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (the device's and the host tier's)."""
        self.engine_core.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> None:
        """vLLM's: drop the adapter's weights (its slot zeroed) once the requests running with it end."""
        self.engine_core.remove_lora(lora_int_id)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (EngineCore.sleep): requests still in the engine finish with the error reason."""
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.sleep_level > 0

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        for sequence_id in core_outputs.started:
            self.output_processor.mark_scheduled(sequence_id, core_outputs.step_time)
        # Offline there is nobody to raise to: a failed sequence finishes with the "error" reason.
        failed = [
            EngineCoreOutput(e.request_id, [], None, FinishReason.ERROR, None, 0) for e in core_outputs.errors
        ]
        for error in core_outputs.errors:
            logger.error("request %s failed: %s", error.request_id, error.message)
        outputs, stopped = self.output_processor.process(core_outputs.outputs + failed, time.monotonic())
        if stopped:
            self.engine_core.abort_requests(stopped)
        return outputs

    # ---- introspection ----------------------------------------------------------------------------

    @property
    def stats(self) -> SchedulerStats:
        return self.engine_core.scheduler.stats
