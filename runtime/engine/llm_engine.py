"""The synchronous engine: owns the tokenizer, scheduler and model runner, and steps them.

One `step()` = schedule -> run the model -> update requests -> build outputs. The async engine and the
offline `LLM` both drive this loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvfleet.runtime.core.scheduler import Scheduler
from kvfleet.runtime.engine.output_processor import OutputProcessor
from kvfleet.runtime.engine.outputs import OutputKind, RequestOutput
from kvfleet.runtime.request import FinishReason, Request, RequestStatus
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.model_runner import ModelRunner
from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Room for activations, logits and allocator slack when the KV pool is sized from GPU memory.
_CUDA_ACTIVATION_RESERVE_BYTES = 2 * GiB
_DEFAULT_CHUNKED_TOKEN_BUDGET = 2048


def _read_chat_template(value: str) -> str:
    """A path to a template file, or the template itself (as vLLM's --chat-template takes it)."""
    if "{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"chat template {value!r} is neither a readable file nor a Jinja template")
    return path.read_text()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            config.tokenizer or config.model
        )
        if config.chat_template is not None:
            self.tokenizer.chat_template = _read_chat_template(config.chat_template)
        self.runner = ModelRunner(config)
        self.runner.load_model()
        self.max_model_len: int = self.runner.max_model_len
        self.vocab_size: int = self.runner.vocab_size
        self.num_kv_blocks = self._num_kv_blocks()
        self.runner.initialize_kv_cache(self.num_kv_blocks)
        self.max_num_batched_tokens = self._token_budget()
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.num_steps = 0
        logger.info(
            "engine ready: model=%s device=%s max_model_len=%d kv_blocks=%d x %d tokens, token budget %d",
            config.model,
            self.runner.device,
            self.max_model_len,
            self.num_kv_blocks,
            config.block_size,
            self.max_num_batched_tokens,
        )

    def _num_kv_blocks(self) -> int:
        config = self.config
        blocks_per_sequence = math.ceil(self.max_model_len / config.block_size)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            per_block = self.runner.kv_cache_bytes_per_block()
            if self.runner.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.runner.device)
                used_by_others = total - free
                budget = (
                    total * config.gpu_memory_utilization - used_by_others - _CUDA_ACTIVATION_RESERVE_BYTES
                )
            else:
                budget = config.cpu_kv_cache_space * GiB
            num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; raise the memory budget or shrink the model")
        if num_blocks < blocks_per_sequence:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len} tokens: lower max_model_len or enlarge the cache"
            )
        return num_blocks

    def _token_budget(self) -> int:
        config = self.config
        if config.max_num_batched_tokens is not None:
            if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({config.max_num_batched_tokens}) must reach max_model_len "
                    f"({self.max_model_len}) when chunked prefill is off, or long prompts could never run"
                )
            return config.max_num_batched_tokens
        if config.enable_chunked_prefill:
            return max(_DEFAULT_CHUNKED_TOKEN_BUDGET, config.max_num_seqs)
        return max(self.max_model_len, config.max_num_seqs)

    # ---- requests -------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for input the engine cannot serve; nothing has been changed at that point."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but the model's context is "
                f"{self.max_model_len} tokens, leaving no room for output"
            )

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
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises ValueError on bad input.

        `prompt_token_ids`, when the caller has already tokenized (and validated) a text prompt, saves doing
        it twice.
        """
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be positive")
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize(prompt)
            self.validate_prompt(prompt_token_ids, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        deadline = arrival_time + timeout if timeout is not None else None

        sequence_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        self.output_processor.add_request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_token_ids,
            params,
            output_kind,
            sequence_ids,
            arrival_time,
        )
        for index, sequence_id in enumerate(sequence_ids):
            sequence_params = params
            if params.n > 1:
                seed = params.seed + index if params.seed is not None else None
                sequence_params = dataclasses.replace(params, n=1, seed=seed)
            self.scheduler.add_request(
                Request(
                    sequence_id,
                    prompt_token_ids,
                    sequence_params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival_time,
                    priority=priority,
                    deadline=deadline,
                )
            )
        return prompt_token_ids

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their KV blocks are freed at once. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        sequence_ids = [sid for rid in ids for sid in self.output_processor.sequence_ids(rid)]
        if sequence_ids:
            self.scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.output_processor.remove(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        now = time.monotonic()
        for request in scheduler_output.requests:
            self.output_processor.mark_scheduled(request.request_id, now)

        core_outputs = self._execute(scheduler_output)
        outputs, stopped = self.output_processor.process(core_outputs, time.monotonic())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.num_steps += 1
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput([], [], []))
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception:
            # One bad batch must not take the engine down: fail the requests in it, keep serving the rest.
            logger.exception(
                "model step failed; failing the %d requests in it", len(scheduler_output.requests)
            )
            ids = [request.request_id for request in scheduler_output.requests]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            return [EngineCoreOutput(rid, [], None, FinishReason.ERROR, None, 0) for rid in ids]
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    # ---- introspection ----------------------------------------------------------------------------

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats
