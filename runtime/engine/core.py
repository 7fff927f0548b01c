"""The EngineCore: owns the scheduler and the executor (the model's runners), and steps them.

One `step()` = schedule -> run the model -> update requests -> the step's outputs. It takes token ids and
gives token ids: tokenization, detokenization and stop strings belong to the front end (the offline
LLMEngine in-process, or the API server processes on the other side of a socket). A request arriving goes
through the arrival handlers of the features this core serves (arrival.py) before the scheduler queues it.

Failures stay with the request that caused them: a request the core cannot admit is answered with a
RequestError, and when a batch fails the core runs its requests again one by one, so that only those that
fail alone are finished with an error.
"""

from __future__ import annotations

import logging
import math
import os
import time

from kvfleet.runtime.config import AUTO_MAX_MODEL_LEN, EngineConfig
from kvfleet.runtime.core.host_kv_tier import HostKVTier
from kvfleet.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvfleet.runtime.core.scheduler import Scheduler
from kvfleet.runtime.engine.arrival import (
    ArrivalHandler,
    KVTransferParams,
    LoRAAdapters,
    MediaItems,
    PromptHiddenStates,
    PromptLogprobs,
    PromptMRopePositions,
    RopeCacheSalt,
    SamplingTokenRules,
    StructuredOutputs,
    WaitingLimit,
)
from kvfleet.runtime.engine.grammar_compiler import GrammarCompiler
from kvfleet.runtime.engine.messages import AddRequest, EngineCoreOutputs, EngineInfo, RequestError
from kvfleet.runtime.errors import (
    EngineOverloadedError,
    EngineSleepingError,
    InvalidRequestError,
    RequestFailedError,
    RequestShedError,
)
from kvfleet.runtime.executor.executor import WorkerFailedError, make_executor
from kvfleet.runtime.input_checks import check_cache_salt, check_prompt_token_ids, check_resumed_token_ids
from kvfleet.runtime.kv_events.collector import make_event_sink
from kvfleet.runtime.kv_events.publisher import make_event_publisher
from kvfleet.runtime.kv_transfer.base import KVConnectorScheduler
from kvfleet.runtime.kv_transfer.factory import make_scheduler_connector
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import ModalitySpec
from kvfleet.runtime.multimodal.prompt_media import modality_specs
from kvfleet.runtime.request import Request, RequestStatus
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.spec_decode.speculator import Speculator, make_proposer

logger = logging.getLogger(__name__)

GiB = 1 << 30
_DEFAULT_CHUNKED_TOKEN_BUDGET = 2048
# With nothing to run but KV loads under way, a step waits this long for one to end instead of spinning.
_KV_LOAD_WAIT_S = 0.01
# vLLM's sleep mode: its levels, what happens to the requests in the engine when it is put to sleep (ended,
# or let finish first), and what a wake-up takes back.
SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("abort", "wait")
SLEEP_TAGS = ("weights", "kv_cache")


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
        executor = self.executor
        self.max_model_len: int = executor.max_model_len
        self.vocab_size: int = executor.vocab_size
        self.num_kv_blocks = self._num_kv_blocks()
        executor.initialize_kv_cache(self.num_kv_blocks)
        kv_events_config = config.kv_events()
        self.kv_events = make_event_sink(
            kv_events_config, config.block_size, host_tier=config.kv_offloading_size is not None
        )
        host_kv_tier = self._host_kv_tier()
        self.max_num_batched_tokens = self._token_budget()
        model_config = executor.model_config
        multimodal = model_config.multimodal
        # What the model takes besides text, by modality; empty for a text-only model.
        self.modalities: dict[str, ModalitySpec] = (
            {} if multimodal is None else modality_specs(multimodal, config.model)
        )
        self.kv_transfer = config.kv_transfer()
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_active_seqs or config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else None,
            background_priority=background_priority,
            sliding_window=model_config.sliding_window,
            host_kv_tier=host_kv_tier,
            max_num_encoder_input_tokens=self._encoder_budget(),
            kv_connector=self._kv_connector(),
            kv_events=self.kv_events,
        )
        self.speculator = self._speculator()
        # Admitted requests never scheduled yet: the ones load shedding may displace, and whose first
        # scheduling the front end hears of (its queue-time metric).
        self._unstarted: dict[str, AddRequest] = {}
        self._errors: list[RequestError] = []
        self.lora_adapters = LoRAAdapters(executor.add_lora if config.enable_lora else None)
        self.structured_outputs = StructuredOutputs(
            GrammarCompiler(
                config.tokenizer or config.model, self.vocab_size, config.structured_outputs_compile_timeout
            )
        )
        self._arrival_handlers = self._make_arrival_handlers()
        # Whether a reasoning's start and end are configured: what a thinking_token_budget counts and writes.
        self.reasons = config.reasoning_strings() is not None
        # Sleep mode: the level the engine sleeps at (0: awake), the level it falls asleep at once the
        # requests in it finish, and what a wake-up has still to take back.
        self.sleep_level = 0
        self._falling_asleep: int | None = None
        self._asleep: set[str] = set()
        # Last: its sockets and thread are the only part of the core that outlives a failed start.
        self.kv_event_publisher = make_event_publisher(kv_events_config)
        self.num_steps = 0
        logger.info(
            "%s ready: model=%s device=%s max_model_len=%d kv_blocks=%d x %d tokens, budget %d",
            type(self).__name__,
            config.model,
            executor.device,
            self.max_model_len,
            self.num_kv_blocks,
            config.block_size,
            self.max_num_batched_tokens,
        )

    def _kv_connector(self) -> KVConnectorScheduler | None:
        """The scheduler-side half of the KV connector kv_transfer_config names, told where the worker side's
        transport listens."""
        if self.kv_transfer is None:
            return None
        connector = make_scheduler_connector(self.kv_transfer, self.config.block_size)
        connector.set_xfer_handshake_metadata(self.executor.kv_connector_handshake_metadata())
        return connector

    def _speculator(self) -> Speculator | None:
        speculative = self.config.speculative()
        if speculative is None:
            return None
        proposer = make_proposer(
            speculative,
            self.config,
            self.num_kv_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )
        return Speculator(speculative, proposer, self.max_model_len)

    def _make_arrival_handlers(self) -> list[ArrivalHandler]:
        """What a request goes through on arrival, for what this core serves (see arrival.py)."""
        model_config = self.executor.model_config
        handlers: list[ArrivalHandler] = []
        if self.max_waiting_requests is not None:
            handlers.append(
                WaitingLimit(self.max_waiting_requests, self.scheduler.waiting, self._unstarted, self._shed)
            )
        handlers += [
            SamplingTokenRules(self.vocab_size, self.structured_outputs.compiler.encode),
            self.lora_adapters,
            MediaItems(
                self.modalities,
                self.scheduler.max_num_encoder_input_tokens,
                model_config.hidden_size if self.config.enable_prompt_embeds else None,
            ),
            RopeCacheSalt(model_config.rope),
            KVTransferParams(self.kv_transfer, self.config.block_size),
            PromptHiddenStates(self.config.world_size),
            PromptLogprobs(self.config.world_size),
        ]
        if model_config.uses_mrope:
            handlers.append(PromptMRopePositions(self.modalities))
        handlers.append(self.structured_outputs)
        return handlers

    def shutdown(self) -> None:
        """Stop the worker processes, if the executor runs any, the grammar compile processes and the KV
        events publisher."""
        self.executor.shutdown()
        self.structured_outputs.compiler.shutdown()
        self.kv_event_publisher.shutdown()

    @property
    def info(self) -> EngineInfo:
        executor = self.executor
        return EngineInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            attention_backend=executor.attention_backend,
            device=executor.device.type,
            dtype=str(executor.dtype).removeprefix("torch."),
            hidden_size=executor.model_config.hidden_size,
        )

    def _num_kv_blocks(self) -> int:
        """The KV cache's blocks; an auto max_model_len is lowered to the tokens they hold where that is
        fewer than the model's context."""
        config = self.config
        blocks_per_sequence = math.ceil(self.max_model_len / config.block_size)
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
        else:
            num_blocks = int(
                self.executor.kv_cache_budget_bytes() // self.executor.kv_cache_bytes_per_block()
            )
            sized = config.cpu_kv_cache_space is not None or config.kv_cache_memory_bytes is not None
            if self.executor.device.type == "cpu" and not sized:
                # Host memory is zeroed and made resident at start, about a second of CPU time a GiB, and
                # shared with everything else on the node: take no more than the sequences can fill.
                num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_sequence)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; raise the memory budget or shrink the model")
        if num_blocks < blocks_per_sequence and config.max_model_len == AUTO_MAX_MODEL_LEN:
            held = num_blocks * config.block_size
            logger.warning(
                "max_model_len auto: %d, what the KV cache holds (the model's: %d)", held, self.max_model_len
            )
            self.max_model_len = held
        elif num_blocks < blocks_per_sequence:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len} tokens: lower max_model_len (-1: to what the cache "
                "holds) or enlarge the cache"
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
        return HostKVTier(num_blocks, self.kv_events)

    def _token_budget(self) -> int:
        config = self.config
        if config.max_num_scheduled_tokens is not None:
            return config.max_num_scheduled_tokens  # vLLM's scheduler takes it as its budget
        if config.max_num_batched_tokens is not None:
            # The scheduler refuses one too small for a whole prompt when chunked prefill is off.
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

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError for input the engine cannot serve."""
        check_prompt_token_ids(
            prompt_token_ids,
            params.stop_token_ids or [],
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        if params.thinking_token_budget is not None and not self.reasons:
            raise InvalidRequestError(
                "thinking_token_budget needs the engine started with a reasoning parser "
                "(--reasoning-parser) or --reasoning-config, which say where a reasoning starts and ends"
            )

    def add_request(self, add: AddRequest) -> None:
        """Admit a sequence, or answer it with a RequestError in the next step's outputs."""
        request = None
        if self.sleep_level or self.falling_asleep:
            self._refuse(add.request_id, None, EngineSleepingError.kind, "the engine sleeps until woken up")
            return
        try:
            self.validate_prompt(add.prompt_token_ids, add.sampling_params)
            if add.cache_salt is not None:
                check_cache_salt(add.cache_salt)
            if add.resumed_token_ids:
                check_resumed_token_ids(
                    add.resumed_token_ids,
                    vocab_size=self.vocab_size,
                    max_tokens=add.sampling_params.max_tokens,
                )
            request = Request(
                add.request_id,
                add.prompt_token_ids,
                add.sampling_params,
                eos_token_id=add.eos_token_id,
                arrival_time=add.arrival_time,
                priority=add.priority,
                deadline=add.deadline,
                lora_request=add.lora_request,
                mm_features=add.mm_features,
                cache_salt=add.cache_salt,
            )
            # A continuation's tokens are output already generated: computed with the prompt, like a
            # preempted request's.
            request.append_output_token_ids(add.resumed_token_ids)
            for handler in self._arrival_handlers:
                handler.prepare(add, request)
            self.scheduler.add_request(request)
        except (InvalidRequestError, EngineOverloadedError) as error:
            self._refuse(add.request_id, request, error.kind, str(error))
        except ValueError as error:
            self._refuse(add.request_id, request, InvalidRequestError.kind, str(error))
        else:
            self._unstarted[add.request_id] = add

    def _refuse(self, request_id: str, request: Request | None, kind: str, message: str) -> None:
        self._errors.append(RequestError(request_id, kind, message))
        if request is not None:
            # Finished, so that what a handler started for it (its grammar's compile) lets it go.
            request.transition(RequestStatus.FINISHED_ERROR)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, on the device and in the host tier; subscribers hear of it at
        once."""
        self.scheduler.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        events = self.kv_events.take()
        if events:
            self.kv_event_publisher.publish(events)

    def add_lora(self, lora: LoRARequest) -> None:
        """Have the adapter ready to run; raises InvalidRequestError when it cannot run on this model."""
        self.lora_adapters.add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an unloaded adapter's weights and zero its slot, once the requests running with it end."""
        self.lora_adapters.remove(lora_int_id)

    # ---- sleep mode (vLLM's) ----------------------------------------------------------------------

    @property
    def falling_asleep(self) -> bool:
        """A sleep waits for the requests in the engine to finish."""
        return self._falling_asleep is not None

    def sleep(self, level: int, mode: str = "abort") -> None:
        """Free the KV cache (level 1; the weights stay in host memory) or the weights too (level 2), and
        forget the prefix cache, whose blocks are gone. Mode abort ends the requests in the engine with
        EngineSleepingError first; mode wait lets them finish, and the engine falls asleep after them
        (`sleep_level` says when). Requests that arrive meanwhile, and while asleep, are refused with
        EngineSleepingError."""
        self._check_sleep(level, mode)
        if mode == "abort":
            request_ids = list(self.scheduler.requests)
            self.abort_requests(request_ids)
            message = "the engine was put to sleep while this request ran"
            self._errors += [RequestError(i, EngineSleepingError.kind, message) for i in request_ids]
        self._falling_asleep = max(level, self._falling_asleep or 0)
        self._fall_asleep_when_idle()

    def _check_sleep(self, level: int, mode: str) -> None:
        if not self.config.enable_sleep_mode:
            raise InvalidRequestError("sleep mode is off: the engine was not started with enable_sleep_mode")
        if level not in SLEEP_LEVELS:
            raise InvalidRequestError(f"the sleep level must be 1 or 2, not {level}")
        if mode not in SLEEP_MODES:
            raise InvalidRequestError(f"the sleep mode must be one of {', '.join(SLEEP_MODES)}, not {mode!r}")
        if level == 2 and self.config.enable_lora:
            raise InvalidRequestError("sleep level 2 would drop the weights LoRA adapters apply to: use 1")

    def _fall_asleep_when_idle(self) -> None:
        if self._falling_asleep is None or self.scheduler.has_unfinished_requests():
            return
        level = max(self._falling_asleep, self.sleep_level)
        self._falling_asleep = None
        if level == self.sleep_level and self._asleep == set(SLEEP_TAGS):
            return  # asleep so already
        self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        self.executor.sleep(level)
        self.sleep_level = level
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what sleep freed: the parts named ("weights", "kv_cache"), or all of them; the weights
        dropped at level 2 are read again from the model folder. A sleep waiting for requests to finish is
        called off. The engine serves again once nothing is left asleep."""
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise InvalidRequestError(f"unknown wake-up tags {unknown}: the tags are {', '.join(SLEEP_TAGS)}")
        self._falling_asleep = None
        waking = [tag for tag in SLEEP_TAGS if tag in self._asleep and (tags is None or tag in tags)]
        if waking:
            self.executor.wake_up(waking)
            self._asleep -= set(waking)
        if not self._asleep:
            self.sleep_level = 0

    def _shed(self, request_id: str) -> None:
        """Finish a waiting request to make room for one of a higher tier."""
        self.abort_requests([request_id])
        message = "the server is overloaded: a request of a higher tier took this place"
        self._errors.append(RequestError(request_id, RequestShedError.kind, message))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests wherever they are; their KV blocks are freed at once. Unknown ids are ignored."""
        for request_id in request_ids:
            self._unstarted.pop(request_id, None)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's, with the structured outputs' counters."""
        stats = self.scheduler.stats
        compiler = self.structured_outputs.compiler
        stats.grammars_compiled = compiler.num_compiled
        stats.grammar_compile_seconds = compiler.compile_seconds
        self.executor.fill_stats(stats)
        publisher = self.kv_event_publisher
        stats.kv_events_published = publisher.events_published
        stats.kv_event_batches_dropped = publisher.batches_dropped
        stats.kv_event_batches_replayed = publisher.batches_replayed
        stats.sleep_level = self.sleep_level
        return stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._errors)

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for pulls, or KV loads under way: a serving core keeps stepping to let them go, even
        with no request left to run."""
        return self.scheduler.has_pending_kv_transfers()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        for failed in self.structured_outputs.settle():
            self.abort_requests([failed.request_id])
            self._errors.append(failed)
        errors, self._errors = self._errors, []
        step_time = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.structured_outputs.wait_for_one()
            if self.scheduler.has_pending_kv_transfers():
                self.executor.wait_for_kv_transfers(_KV_LOAD_WAIT_S)
        started = [r.request_id for r in scheduler_output.requests if r.request_id in self._unstarted]
        for request_id in started:
            del self._unstarted[request_id]
        outputs = self._execute(scheduler_output, errors)
        if self.scheduler.kv_connector is not None:
            outputs += self._settle_kv_transfers(outputs, errors)
        for output in outputs:
            if output.finish_reason is not None:
                self._unstarted.pop(output.request_id, None)
        self.num_steps += 1
        self._fall_asleep_when_idle()
        self._publish_kv_events()
        return EngineCoreOutputs(
            stats=self.stats, outputs=outputs, errors=errors, started=started, step_time=step_time
        )

    def _settle_kv_transfers(
        self, outputs: list[EngineCoreOutput], errors: list[RequestError]
    ) -> list[EngineCoreOutput]:
        """The prefill calls among the step's outputs answer with where their blocks wait: the blocks are
        offered before the answers leave, so that no pull can arrive first. Loads that failed under the
        policy fail are answered with errors."""
        for request_id, reason in self.scheduler.failed_kv_loads:
            self._unstarted.pop(request_id, None)
            message = f"the prompt's KV could not be loaded from the prefill replica: {reason}"
            errors.append(RequestError(request_id, RequestFailedError.kind, message))
        self.scheduler.failed_kv_loads = []
        if not any(output.kv_transfer_params for output in outputs):
            return []
        return self._execute(self.scheduler.connector_step(), errors)

    def _execute(
        self, scheduler_output: SchedulerOutput, errors: list[RequestError]
    ) -> list[EngineCoreOutput]:
        if scheduler_output.total_num_scheduled_tokens == 0:
            # With a KV connector its orders still go to the worker side, and its news come back.
            runner_output = (
                ModelRunnerOutput([], [], [])
                if scheduler_output.kv_connector_metadata is None
                else self.executor.execute_model(scheduler_output)
            )
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        scheduler_output.removed_lora_ids = self.lora_adapters.take_removals(self.scheduler.requests)
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
                merged.prompt_hidden_states.update(single.prompt_hidden_states)
                merged.prompt_logprobs.update(single.prompt_logprobs)
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
