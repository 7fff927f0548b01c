"""The EngineCore: owns the scheduler, the KV cache and the model runner, and steps them.

One `step()` = schedule -> run the model -> update requests -> the step's outputs. It takes token ids and
gives token ids: tokenization, detokenization and stop strings belong to the front end (the offline
LLMEngine in-process, or the API server processes on the other side of a socket).

Failures stay with the request that caused them: a request the core cannot admit is answered with a
RequestError, and when a batch fails the core runs its requests again one by one, so that only those that
fail alone are finished with an error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import time

from kvfleet.contract.precedence import QueuedRequest, choose_victim
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.host_kv_tier import HostKVTier
from kvfleet.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvfleet.runtime.core.scheduler import Scheduler
from kvfleet.runtime.engine.errors import (
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
    RequestShedError,
)
from kvfleet.runtime.engine.grammar_compiler import GrammarCompiler, RequestGrammar
from kvfleet.runtime.engine.input_checks import check_prompt_token_ids, check_sampling_token_ids
from kvfleet.runtime.engine.messages import AddRequest, EngineCoreOutputs, EngineInfo, RequestError
from kvfleet.runtime.executor.executor import WorkerFailedError, make_executor
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.models.layers import rope_cache_salt
from kvfleet.runtime.multimodal.inputs import ModalitySpec, check_features
from kvfleet.runtime.multimodal.mrope import MRopePositions
from kvfleet.runtime.multimodal.prompt_media import modality_specs
from kvfleet.runtime.request import Request, RequestStatus
from kvfleet.runtime.spec_decode.speculator import Speculator, make_proposer
from kvfleet.runtime.structured_outputs.token_rules import TokenRules

logger = logging.getLogger(__name__)

GiB = 1 << 30
_DEFAULT_CHUNKED_TOKEN_BUDGET = 2048
# With nothing to run but grammars compiling, a step waits this long for one of them instead of spinning.
_GRAMMAR_WAIT_S = 0.01


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_waiting_requests: int | None = None,
        reserved_cpus: int = 0,
        background_priority: int | None = None,
    ) -> None:
        """`reserved_cpus`: CPUs left to the API servers in small steps, when the core runs beside them.
        `background_priority`: requests this urgent or less (the batch tier) only take the capacity the
        others leave."""
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.executor = make_executor(config, reserved_cpus=reserved_cpus)
        try:
            self._start(config, background_priority)
        except BaseException:
            self.executor.shutdown()
            raise

    def _start(self, config: EngineConfig, background_priority: int | None) -> None:
        self.runner = self.executor.runner
        self.max_model_len: int = self.runner.max_model_len
        self.vocab_size: int = self.runner.vocab_size
        self.num_kv_blocks = self._num_kv_blocks()
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        host_kv_tier = self._host_kv_tier()
        self.max_num_batched_tokens = self._token_budget()
        multimodal = self.runner.model_config.multimodal
        # What the model takes besides text, by modality; empty for a text-only model.
        self.modalities: dict[str, ModalitySpec] = (
            {} if multimodal is None else modality_specs(multimodal, config.model)
        )
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else None,
            background_priority=background_priority,
            sliding_window=self.runner.model_config.sliding_window,
            host_kv_tier=host_kv_tier,
            max_num_encoder_input_tokens=self._encoder_budget(),
        )
        speculative = config.speculative()
        self.speculator = (
            None
            if speculative is None
            else Speculator(
                speculative,
                make_proposer(speculative, config, self.runner, self.num_kv_blocks),
                self.max_model_len,
            )
        )
        # Admitted requests never scheduled yet: the ones load shedding may displace, and whose first
        # scheduling the front end hears of (its queue-time metric).
        self._unstarted: dict[str, AddRequest] = {}
        self._errors: list[RequestError] = []
        # Adapters unloaded by their API server, dropped from the runner once no request runs with them.
        self._lora_removals: set[int] = set()
        self.grammar_compiler = GrammarCompiler(
            config.tokenizer or config.model, self.vocab_size, config.structured_outputs_compile_timeout
        )
        # Requests whose grammar was still compiling when they were admitted.
        self._compiling: dict[str, Request] = {}
        self.num_steps = 0
        logger.info(
            "%s ready: model=%s device=%s max_model_len=%d kv_blocks=%d x %d tokens, budget %d",
            type(self).__name__,
            config.model,
            self.runner.device,
            self.max_model_len,
            self.num_kv_blocks,
            config.block_size,
            self.max_num_batched_tokens,
        )

    def shutdown(self) -> None:
        """Stop the worker processes, if the executor runs any, and the grammar compile processes."""
        self.executor.shutdown()
        self.grammar_compiler.shutdown()

    @property
    def info(self) -> EngineInfo:
        runner = self.runner
        return EngineInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            attention_backend=runner.attention_backend.name,
            device=runner.device.type,
            dtype=str(runner.dtype).removeprefix("torch."),
        )

    def _num_kv_blocks(self) -> int:
        config = self.config
        blocks_per_sequence = math.ceil(self.max_model_len / config.block_size)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = int(
                self.executor.kv_cache_budget_bytes() // self.executor.kv_cache_bytes_per_block()
            )
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; raise the memory budget or shrink the model")
        if num_blocks < blocks_per_sequence:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len} tokens: lower max_model_len or enlarge the cache"
            )
        return num_blocks

    def _host_kv_tier(self) -> HostKVTier | None:
        """The host-memory KV tier kv_offloading_size asks for; refused if the host cannot hold it."""
        size = self.config.kv_offloading_size
        if size is None:
            return None
        available = _available_host_memory()
        if size * GiB > available:
            raise ValueError(
                f"kv_offloading_size {size:g} GiB is more than the host's available memory "
                f"({available / GiB:.1f} GiB)"
            )
        num_blocks = int(size * GiB // self.executor.kv_cache_bytes_per_block())
        if num_blocks < 1:
            raise ValueError(f"kv_offloading_size {size:g} GiB holds no KV block of this model")
        self.executor.initialize_host_kv_tier(num_blocks)
        return HostKVTier(num_blocks)

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

    def _encoder_budget(self) -> int:
        """max_num_encoder_input_tokens, by default the token budget or the largest item, whichever is more
        (as vLLM's); every item must fit in one step's budget."""
        requested = self.config.max_num_encoder_input_tokens
        largest = max((spec.max_item_tokens for spec in self.modalities.values()), default=0)
        if requested is None:
            return max(self.max_num_batched_tokens, largest)
        if requested < largest:
            raise ValueError(
                f"max_num_encoder_input_tokens ({requested}) is less than the largest item's {largest} "
                f"embeddings ({' or '.join(self.modalities)})"
            )
        return requested

    # ---- requests -------------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], stop_token_ids: list[int]) -> None:
        """Raises InvalidRequestError for input the engine cannot serve."""
        check_prompt_token_ids(
            prompt_token_ids, stop_token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )

    def add_request(self, add: AddRequest) -> None:
        """Admit a sequence, or answer it with a RequestError in the next step's outputs."""
        try:
            self.validate_prompt(add.prompt_token_ids, add.sampling_params.stop_token_ids or [])
            self._make_room(add)
            params = add.sampling_params
            check_sampling_token_ids(params, vocab_size=self.vocab_size)
            structured = params.structured_outputs
            grammar = (
                None if structured is None else RequestGrammar(self.grammar_compiler.compile(structured))
            )
            token_rules = TokenRules.of(params, self.vocab_size, self.grammar_compiler.encode)
            if add.lora_request is not None:
                self.add_lora(add.lora_request)
            self._check_mm_features(add)
            request = Request(
                add.request_id,
                add.prompt_token_ids,
                add.sampling_params,
                eos_token_id=add.eos_token_id,
                arrival_time=add.arrival_time,
                priority=add.priority,
                deadline=add.deadline,
                grammar=grammar,
                token_rules=token_rules,
                lora_request=add.lora_request,
                cache_salt=rope_cache_salt(self.runner.model_config.rope, len(add.prompt_token_ids)),
                mm_features=add.mm_features,
                mrope_positions=(
                    MRopePositions.of(len(add.prompt_token_ids), add.mm_features, self.modalities)
                    if self.runner.model_config.uses_mrope
                    else None
                ),
            )
            self.scheduler.add_request(request)
        except (InvalidRequestError, EngineOverloadedError) as error:
            self._errors.append(RequestError(add.request_id, error.kind, str(error)))
            return
        except ValueError as error:
            self._errors.append(RequestError(add.request_id, InvalidRequestError.kind, str(error)))
            return
        self._unstarted[add.request_id] = add
        if grammar is not None and not grammar.ready:
            self._compiling[add.request_id] = request

    def _check_mm_features(self, add: AddRequest) -> None:
        """Raises InvalidRequestError for items of a modality the model does not take, or that do not fit
        the model."""
        if not self.modalities and not add.mm_features:
            return
        try:
            check_features(
                add.prompt_token_ids,
                add.mm_features,
                self.modalities,
                max_item_tokens=self.scheduler.max_num_encoder_input_tokens,
            )
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None

    def add_lora(self, lora: LoRARequest) -> None:
        """Have the adapter ready to run; raises InvalidRequestError when it cannot run on this model."""
        lora_manager = self.runner.lora_manager
        if lora_manager is None:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled")
        try:
            lora_manager.add(lora)
        except LoRAAdapterError as error:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r}: {error}") from None
        # Loaded again (the same files under a name) before its removal was done.
        self._lora_removals.discard(lora.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an unloaded adapter's weights and zero its slot, once the requests running with it end."""
        self._lora_removals.add(lora_int_id)

    def _take_lora_removals(self) -> list[int]:
        if not self._lora_removals:
            return []
        in_use = {request.lora_int_id for request in self.scheduler.requests.values()}
        done = sorted(self._lora_removals - in_use)
        self._lora_removals.difference_update(done)
        return done

    def _make_room(self, add: AddRequest) -> None:
        """Under --max-waiting-requests, shed a waiting request of a lower tier, or refuse this one."""
        limit = self.max_waiting_requests
        if limit is None or len(self.scheduler.waiting) < limit:
            return
        queued = [QueuedRequest(a.request_id, a.priority, a.arrival_time) for a in self._unstarted.values()]
        victim = choose_victim(queued, add.priority)
        if victim is None:
            raise EngineOverloadedError(f"the server is overloaded: {limit} requests are waiting")
        self.abort_requests([victim])
        message = "the server is overloaded: a request of a higher tier took this place"
        self._errors.append(RequestError(victim, RequestShedError.kind, message))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests wherever they are; their KV blocks are freed at once. Unknown ids are ignored."""
        for request_id in request_ids:
            self._unstarted.pop(request_id, None)
            self._compiling.pop(request_id, None)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's, with the structured outputs' counters."""
        stats = self.scheduler.stats
        masks = self.runner.sampler.grammar_masks
        stats.grammars_compiled = self.grammar_compiler.num_compiled
        stats.grammar_compile_seconds = self.grammar_compiler.compile_seconds
        stats.grammar_mask_steps = masks.num_steps
        stats.grammar_mask_seconds = masks.seconds
        encoders = self.runner.encoder_runner
        if encoders is not None:
            stats.encoder_runs = encoders.num_encoder_runs
            stats.encoder_cache_hits = encoders.num_cache_hits
        return stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._errors)

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        if self._compiling:
            self._settle_compiled_grammars()
        errors, self._errors = self._errors, []
        step_time = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0 and self._compiling:
            concurrent.futures.wait(
                [request.grammar.compiled for request in self._compiling.values() if request.grammar],
                timeout=_GRAMMAR_WAIT_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        started = [r.request_id for r in scheduler_output.requests if r.request_id in self._unstarted]
        for request_id in started:
            del self._unstarted[request_id]
        outputs = self._execute(scheduler_output, errors)
        for output in outputs:
            if output.finish_reason is not None:
                self._unstarted.pop(output.request_id, None)
        self.num_steps += 1
        return EngineCoreOutputs(
            stats=self.stats, outputs=outputs, errors=errors, started=started, step_time=step_time
        )

    def _settle_compiled_grammars(self) -> None:
        """Forget requests whose grammar has compiled; finish those whose grammar failed to, alone."""
        for request_id, request in list(self._compiling.items()):
            grammar = request.grammar
            assert grammar is not None
            if grammar.ready or request.is_finished:
                del self._compiling[request_id]
                continue
            error = grammar.error
            if error is not None:
                del self._compiling[request_id]
                self.abort_requests([request_id])
                self._errors.append(RequestError(request_id, error.kind, str(error)))

    def _execute(
        self, scheduler_output: SchedulerOutput, errors: list[RequestError]
    ) -> list[EngineCoreOutput]:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput([], [], []))
        scheduler_output.removed_lora_ids = self._take_lora_removals()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except WorkerFailedError:
            raise  # the group is broken: nothing can run any more
        except Exception as exc:
            if scheduler_output.num_reqs == 1:
                request = scheduler_output.requests[0]
                self._fail(request, exc, errors)
                return self.scheduler.update_from_output(
                    scheduler_output, ModelRunnerOutput([request.request_id], [[]], [None])
                )
            logger.warning(
                "model step failed for a batch of %d (%s); running its requests one by one",
                scheduler_output.num_reqs,
                exc,
            )
            runner_output = self._execute_one_by_one(scheduler_output, errors)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _execute_one_by_one(
        self, scheduler_output: SchedulerOutput, errors: list[RequestError]
    ) -> ModelRunnerOutput:
        """The batch's results, each request run alone. Those that fail alone are finished with an error,
        which update_from_output then skips. Rewriting the KV slots of a step gives the same values."""
        merged = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        for index, request in enumerate(scheduler_output.requests):
            sampled: list[int] = []
            logprobs = None
            try:
                single = self.executor.execute_model(scheduler_output.subset([index]))
                sampled, logprobs = single.sampled_token_ids[0], single.logprobs[0]
            except WorkerFailedError:
                raise
            except Exception as exc:
                self._fail(request, exc, errors)
            merged.req_ids.append(request.request_id)
            merged.sampled_token_ids.append(sampled)
            merged.logprobs.append(logprobs)
        return merged

    def _fail(self, request: Request, exc: Exception, errors: list[RequestError]) -> None:
        logger.error("request %s failed in the model step", request.request_id, exc_info=exc)
        self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self._unstarted.pop(request.request_id, None)
        message = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        errors.append(RequestError(request.request_id, RequestFailedError.kind, message))


def _available_host_memory() -> int:
    """Bytes the host can still give without swapping: MemAvailable on Linux, else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
