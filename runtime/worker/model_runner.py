"""Runs one scheduled step: flattens the batch into input tensors, runs the model over the paged KV cache,
computes logits for the rows that sample, and samples them. A request that feeds draft tokens (speculative
decoding) gets logits at its last real token and at each draft token, and the sampler verifies the drafts."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import mmap
from collections.abc import Collection

import numpy as np
import torch
import torch.distributed as dist
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.selector import select_attention_backend
from kvfleet.runtime.config import AUTO_MAX_MODEL_LEN, EngineConfig
from kvfleet.runtime.core.host_kv_tier import TierCopies
from kvfleet.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvfleet.runtime.distributed.parallel import local_kv_heads, parallel_context
from kvfleet.runtime.kernels.fused_layers import Implementation, implementation_for
from kvfleet.runtime.kv_transfer.base import KVConnectorWorker
from kvfleet.runtime.kv_transfer.factory import make_worker_connector
from kvfleet.runtime.lora.manager import LoRAManager
from kvfleet.runtime.models.cpu_decode_layers import bind_cpu_decode_layers
from kvfleet.runtime.models.loader import LoadStats, load_model, resolve_device, resolve_dtype
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe_config import MoeLayerLoad
from kvfleet.runtime.models.rope import LENGTH_DEPENDENT_ROPE_TYPES
from kvfleet.runtime.startup_phases import STARTUP_PHASES
from kvfleet.runtime.worker.cpu_threads import cpu_threads
from kvfleet.runtime.worker.encoder_runner import EncoderRunner
from kvfleet.runtime.worker.prompt_logprobs import score_prompt_rows
from kvfleet.runtime.worker.prompt_pooling import PromptPooler
from kvfleet.runtime.worker.sampler import Sampler, SpeculativeBatch
from kvfleet.runtime.worker.step_inputs import StepInputs
from kvfleet.runtime.worker.thinking_budget import ThinkingBudgets
from torch import nn

logger = logging.getLogger(__name__)


class _HostBuffer:
    """A reusable host array that grows on demand; on CUDA it is pinned so the copy to the device is async."""

    def __init__(self, dtype: torch.dtype, pinned: bool) -> None:
        self.dtype = dtype
        self.pinned = pinned
        self.tensor = torch.empty(0, dtype=dtype)
        self.array = self.tensor.numpy()

    def get(self, size: int) -> np.ndarray:
        if size > self.array.shape[0]:
            capacity = max(size, 2 * self.array.shape[0], 256)
            self.tensor = torch.empty(capacity, dtype=self.dtype, pin_memory=self.pinned)
            self.array = self.tensor.numpy()
        return self.array[:size]

    def to_device(self, size: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.tensor[:size]  # the step reads it before the next one refills it
        return self.tensor[:size].to(device, non_blocking=True)


GiB = 1 << 30
# Room for activations, logits and allocator slack when the KV pool is sized from GPU memory.
_CUDA_ACTIVATION_RESERVE_BYTES = 2 * GiB
# The most the KV cache takes on the CPU when cpu_kv_cache_space is unset (the engine core sizes it to what
# its sequences can fill, up to this).
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 1.0


class ModelRunner:
    def __init__(self, config: EngineConfig, *, reserved_cpus: int = 0) -> None:
        """`reserved_cpus`: CPUs that processes beside this one (API servers) need while a step runs."""
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_folder(config.model, config.hf_overrides)
        if config.enable_lora and self.model_config.moe is not None:
            raise ValueError(
                f"enable_lora is not supported for {self.model_config.architecture}: adapters apply to dense "
                "MLPs, and a mixture-of-experts layer has experts instead"
            )
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.block_size = config.block_size
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = self._max_model_len()
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self._cpu_threads = cpu_threads(reserved_cpus) if self.device.type == "cpu" else None
        # This rank's share of the model (all of it outside a tensor- or pipeline-parallel worker).
        self.parallel = parallel = parallel_context()
        self.num_layers = self.model_config.num_hidden_layers // parallel.pp_size
        self.attention_spec = AttentionSpec(
            num_heads=self.model_config.num_attention_heads // parallel.tp_size,
            num_kv_heads=local_kv_heads(self.model_config, parallel.tp_size),
            head_dim=self.model_config.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
        )
        self.attention_backend = self._make_attention_backend()
        self.model: nn.Module | None = None
        self.load_stats = LoadStats()
        self.lora_manager: LoRAManager | None = None
        # A multimodal model's encoders and their cache; None for text-only models.
        self.encoder_runner: EncoderRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        # The blocks of the device cache and of the host tier, for a wake-up to allocate them again.
        self.num_kv_blocks = 0
        self.num_host_kv_blocks = 0
        # The host-memory tier's blocks, in the device cache's layout (pinned on CUDA); empty without one.
        self.host_kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler(self.device, config.seed, config.logprobs_mode, _thinking_budgets(config))
        self.prompt_pooler = PromptPooler()
        # The worker-side half of disaggregated prefill and decode's KV connector; None without one.
        kv_transfer = config.kv_transfer()
        self.kv_connector: KVConnectorWorker | None = (
            None if kv_transfer is None else make_worker_connector(kv_transfer)
        )
        pinned = self.device.type == "cuda"
        self._input_ids = _HostBuffer(torch.int64, pinned)
        self._positions = _HostBuffer(torch.int64, pinned)
        self._slot_mapping = _HostBuffer(torch.int64, pinned)
        self._query_start_loc = _HostBuffer(torch.int32, pinned)
        self._seq_lens = _HostBuffer(torch.int32, pinned)
        self._block_tables = _HostBuffer(torch.int32, pinned)
        self._logits_indices = _HostBuffer(torch.int64, pinned)
        # Each token's sequence length, for the rope types whose angles depend on it.
        self._rope_sequence_lengths = (
            _HostBuffer(torch.int64, pinned)
            if self.model_config.rope["rope_type"] in LENGTH_DEPENDENT_ROPE_TYPES
            else None
        )
        # Marks when the device has read the host buffers (their copies are asynchronous on CUDA).
        self._inputs_copied: torch.cuda.Event | None = None

    def _max_model_len(self) -> int:
        limit = self.model_config.max_context
        requested = self.config.max_model_len
        if requested in (None, AUTO_MAX_MODEL_LEN):
            return limit  # the engine core lowers an auto one to what the KV cache holds
        if requested > limit:
            raise ValueError(
                f"max_model_len {requested} exceeds what the model supports ({limit} tokens, from its "
                "max_position_embeddings and RoPE scaling)"
            )
        return requested

    def _make_attention_backend(self) -> AttentionBackend:
        with STARTUP_PHASES.phase("attention_backend"):
            backend_class, self.attention_backend_reason = select_attention_backend(
                self.attention_spec,
                self.config.attention_backend,
                num_layers=self.model_config.num_hidden_layers,
            )
            return backend_class(self.attention_spec)

    def load_model(self) -> None:
        with STARTUP_PHASES.phase("weights"):
            self.model = load_model(
                self.config.model,
                self.model_config,
                self.attention_backend,
                dtype=self.dtype,
                device=self.device,
                max_position=self.max_model_len,
                use_tqdm=self.config.use_tqdm_on_load,
                stats=self.load_stats,
                quantization=self.config.quantization,
            )
        if hasattr(self.model, "embed_multimodal") or self.config.enable_prompt_embeds:
            self.encoder_runner = EncoderRunner(self.model, self.device)
        config = self.config
        if config.enable_lora:
            self.lora_manager = LoRAManager(
                self.model,
                self.model_config,
                max_loras=config.max_loras,
                max_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras or config.max_loras,
                dtype=self.dtype,
                device=self.device,
                # Triton's kernels where the model's own fused kernels run, and wherever the Triton
                # attention backend was chosen (on the CPU only through Triton's interpreter).
                use_triton=implementation_for(self.device, self.dtype) is Implementation.CUDA
                or self.attention_backend.name == "triton",
            )
        # After LoRA has wrapped the projections it adapts, which keep the layers' own forward.
        bind_cpu_decode_layers(self.model, self.attention_backend)

    def kv_cache_budget_bytes(self) -> float:
        """Memory the KV cache may take: kv_cache_memory_bytes where set; else on CUDA what
        gpu_memory_utilization leaves after the weights and everyone else's use, less room for activations,
        and on the CPU cpu_kv_cache_space, or at most a GiB."""
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            return float(config.kv_cache_memory_bytes)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            return total * config.gpu_memory_utilization - used_by_others - _CUDA_ACTIVATION_RESERVE_BYTES
        return (config.cpu_kv_cache_space or DEFAULT_CPU_KV_CACHE_SPACE_GIB) * GiB

    def kv_cache_bytes_per_block(self) -> int:
        spec = self.attention_spec
        per_layer = 2 * self.block_size * spec.num_kv_heads * spec.head_dim * self.dtype.itemsize
        return per_layer * self.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        spec = self.attention_spec
        shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.num_kv_blocks = num_blocks
        self.kv_caches = []  # free the old cache before allocating the new one
        with STARTUP_PHASES.phase("kv_cache"):
            # Zeros, not empty: padded context slots are masked, and masked garbage must not be NaN.
            self.kv_caches = [_zeroed(shape, self.dtype, self.device) for _ in range(self.num_layers)]
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        logger.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**20,
        )

    def initialize_host_kv_tier(self, num_blocks: int) -> None:
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must run before initialize_host_kv_tier()")
        self.num_host_kv_blocks = num_blocks
        shape = (2, num_blocks, *self.kv_caches[0].shape[2:])
        pinned = self.device.type == "cuda"
        self.host_kv_caches = [
            torch.zeros(shape, dtype=self.dtype, pin_memory=True)
            if pinned
            else _zeroed(shape, self.dtype, torch.device("cpu"))
            for _ in range(len(self.kv_caches))
        ]
        logger.info(
            "host KV tier: %d blocks, %.1f MiB",
            num_blocks,
            num_blocks * self.kv_cache_bytes_per_block() / 2**20,
        )

    def sleep(self, level: int) -> None:
        """vLLM's sleep levels: both free the KV cache and the host tier's blocks; level 1 keeps the weights
        in host memory (moved there from an accelerator), level 2 drops them."""
        self.kv_caches = []
        self.host_kv_caches = []
        if level >= 2:
            self.model = None
            self.encoder_runner = None
        elif self.model is not None and self.device.type != "cpu":
            self.model.to("cpu")
        _release_freed_memory(self.device)
        logger.info("asleep at level %d", level)

    def wake_up(self, tags: Collection[str]) -> None:
        """Take back what sleep freed, weights first (as vLLM does): "weights" moves them back to the
        accelerator, or reads them again from the model folder after level 2; "kv_cache" allocates the KV
        cache and the host tier again, empty."""
        if "weights" in tags:
            if self.model is None:
                self.load_model()
            elif self.device.type != "cpu":
                self.model.to(self.device)
        if "kv_cache" in tags and not self.kv_caches:
            self.initialize_kv_cache(self.num_kv_blocks)
            if self.num_host_kv_blocks:
                self.initialize_host_kv_tier(self.num_host_kv_blocks)

    def _copy_between_tiers(self, copies: TierCopies) -> None:
        """Device blocks to the host tier first (a preempted request's blocks, which this step may reuse),
        then host blocks back into the device blocks of the requests resuming."""
        if copies.to_host:
            device_ids = torch.tensor([d for d, _ in copies.to_host], device=self.device)
            host_ids = torch.tensor([h for _, h in copies.to_host])
            for device_cache, host_cache in zip(self.kv_caches, self.host_kv_caches, strict=True):
                host_cache[:, host_ids] = device_cache[:, device_ids].cpu()
        if copies.to_device:
            host_ids = torch.tensor([h for h, _ in copies.to_device])
            device_ids = torch.tensor([d for _, d in copies.to_device], device=self.device)
            for device_cache, host_cache in zip(self.kv_caches, self.host_kv_caches, strict=True):
                device_cache[:, device_ids] = host_cache[:, host_ids].to(self.device)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.model is None or not self.kv_caches:
            raise RuntimeError("load_model() and initialize_kv_cache() must run before execute_model()")
        metadata = scheduler_output.kv_connector_metadata
        if metadata is not None and self.kv_connector is not None:
            self.kv_connector.start_load_kv(metadata)
        if scheduler_output.requests:
            step = StepInputs.of(scheduler_output)
            speculative = self.prepare_sampling(scheduler_output, step)
            hidden = self._final_hidden_states(step)
            logit_hidden = self._logit_rows(hidden, step)
            logits = None if logit_hidden is None else self.model.compute_logits(logit_hidden)
            output = self.sample(scheduler_output, step, speculative, logits)
            if hidden is not None:
                output.prompt_hidden_states = self._pooled_prompts(
                    scheduler_output, step, hidden, logit_hidden
                )
                output.prompt_logprobs = {
                    step.request_ids[i]: (
                        rows.first_position,
                        score_prompt_rows(
                            self.model.compute_logits,
                            hidden,
                            rows,
                            self.config.logprobs_mode.endswith("logits"),
                        ),
                    )
                    for i, rows in step.prompt_logprob_rows.items()
                }
        else:  # only the connector's orders: a step whose requests all wait
            output = ModelRunnerOutput([], [], [])
        # Reported by whole steps only (those that carry orders), so that a batch run again one request at a
        # time reports nothing twice; a step that failed leaves its news for the next one.
        if metadata is not None and self.kv_connector is not None:
            output.kv_connector_output = self.kv_connector.get_finished()
        return output

    def _pooled_prompts(
        self,
        scheduler_output: SchedulerOutput,
        step: StepInputs,
        hidden: torch.Tensor,
        logit_hidden: torch.Tensor | None,
    ) -> dict[str, list[float]]:
        """The pooled prompts of the requests whose prompt ends this step, once this step's rows are kept."""
        for i, rows in step.pooled_prompt_rows.items():
            pooling = scheduler_output.requests[i].sampling_params.prompt_pooling
            assert pooling is not None
            self.prompt_pooler.keep(step.request_ids[i], pooling, rows, hidden)
        pooled = {}
        for i, row in step.prompt_hidden_state_rows.items():
            pooling = scheduler_output.requests[i].sampling_params.prompt_pooling
            assert pooling is not None and logit_hidden is not None
            pooled[step.request_ids[i]] = self.prompt_pooler.pooled(
                step.request_ids[i], pooling, logit_hidden[row]
            )
        return pooled

    def expert_load(self) -> list[MoeLayerLoad]:
        """The routing load of the mixture-of-experts layers this rank holds; none for a dense model."""
        report = getattr(self.model, "expert_load", None)
        return [] if report is None else report()

    def prepare_sampling(
        self, scheduler_output: SchedulerOutput, step: StepInputs
    ) -> SpeculativeBatch | None:
        """Before the forward pass: forget finished requests, and start the sampler's work that does not need
        the logits (grammar masks fill during the forward pass with an accelerator). Returns the drafts to
        verify, if any request speculates."""
        self.sampler.forget(scheduler_output.finished_request_ids)
        self.prompt_pooler.forget(scheduler_output.finished_request_ids)
        sampling = [scheduler_output.requests[i] for i in step.sample_rows]
        speculative = None
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_decode_tokens:
            drafts = [spec_decode_tokens.get(request.request_id, []) for request in sampling]
            speculative = SpeculativeBatch.of(sampling, drafts)
        self.sampler.prepare(sampling if speculative is None else speculative.rows)
        return speculative

    @torch.inference_mode()
    def compute_logits(self, step: StepInputs) -> torch.Tensor | None:
        """Run the model over the step; the logits of its logit rows, or None when no request samples. On a
        pipeline stage before the last, the stage's output goes to the next stage and None comes back."""
        if self.parallel.pp_size > 1:
            self._start_step(step)
            return self._pipeline_logits(step) if step.request_ids else None
        hidden = self.logit_hidden_states(step)
        return None if hidden is None else self.model.compute_logits(hidden)

    def logit_hidden_states(self, step: StepInputs) -> torch.Tensor | None:
        """Run the whole model (one stage) over the step; the final hidden states of its logit rows, or None
        when no request samples."""
        return self._logit_rows(self._final_hidden_states(step), step)

    def _final_hidden_states(self, step: StepInputs) -> torch.Tensor | None:
        """Run the whole model (one stage) over the step; the final hidden state of every token fed, or None
        for a step without requests."""
        self._start_step(step)
        if not step.request_ids:
            return None
        input_ids, positions, metadata = self._prepare_inputs(step)
        return self._forward(input_ids, positions, metadata, step)

    def _logit_rows(self, hidden: torch.Tensor | None, step: StepInputs) -> torch.Tensor | None:
        if hidden is None or not step.logit_rows:
            return None
        return self._select_rows(hidden, step.logit_rows, step.total_num_scheduled_tokens)

    def _start_step(self, step: StepInputs) -> None:
        if self.model is None or not self.kv_caches:
            raise RuntimeError("load_model() and initialize_kv_cache() must run before a step")
        self._copy_between_tiers(step.tier_copies)

    def _pipeline_logits(self, step: StepInputs) -> torch.Tensor | None:
        """This stage's part of the step, as one micro-batch per stage: a stage sends a micro-batch's output
        on (without waiting for it to be received) and starts the next micro-batch, so that while the next
        stage runs micro-batch i this one runs i + 1. The last stage returns the logits of all of them."""
        assert self.model is not None
        parallel = self.parallel
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        logits: list[torch.Tensor] = []
        for micro_batch in step.split(parallel.pp_size):
            input_ids, positions, metadata = self._prepare_inputs(micro_batch)
            stage_input = None
            if not parallel.is_first_stage:
                shape = (2, metadata.num_tokens, self.model_config.hidden_size)
                stage_input = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(stage_input, src=parallel.previous_stage_rank, group=parallel.world_group)
            output = self._forward(input_ids, positions, metadata, micro_batch, stage_input)
            if not parallel.is_last_stage:
                # The tensor is kept until its send completes.
                work = dist.isend(output, dst=parallel.next_stage_rank, group=parallel.world_group)
                sends.append((work, output))
            elif micro_batch.logit_rows:
                rows = self._select_rows(output, micro_batch.logit_rows, metadata.num_tokens)
                logits.append(self.model.compute_logits(rows))
        for work, _ in sends:
            work.wait()
        return torch.cat(logits) if logits else None

    def sample(
        self,
        scheduler_output: SchedulerOutput,
        step: StepInputs,
        speculative: SpeculativeBatch | None,
        logits: torch.Tensor | None,
    ) -> ModelRunnerOutput:
        """The step's tokens from its logits (one row per entry of step.logit_rows)."""
        requests = scheduler_output.requests
        sampled: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[dict[int, float]] | None] = [None for _ in requests]
        if logits is not None and speculative is not None:
            verified = self.sampler.verify(logits, speculative)
            for row, i in enumerate(step.sample_rows):
                sampled[i] = verified.token_ids[row]
                logprobs[i] = verified.logprobs[row]
        elif logits is not None:
            result = self.sampler(logits, [requests[i] for i in step.sample_rows])
            for row, i in enumerate(step.sample_rows):
                sampled[i] = [result.token_ids[row]]
                row_logprobs = result.logprobs[row]
                logprobs[i] = None if row_logprobs is None else [row_logprobs]
        return ModelRunnerOutput(
            req_ids=[r.request_id for r in requests], sampled_token_ids=sampled, logprobs=logprobs
        )

    @torch.inference_mode()
    def greedy_last_tokens(self, scheduler_output: SchedulerOutput, vocab_size: int) -> list[int]:
        """Run the step and return each request's most likely next token after its last fed token, among the
        first vocab_size ids (a draft model proposing for a target of that vocabulary)."""
        if self.model is None or not self.kv_caches:
            raise RuntimeError("load_model() and initialize_kv_cache() must run before greedy_last_tokens()")
        step = StepInputs.of(scheduler_output)
        input_ids, positions, metadata = self._prepare_inputs(step)
        hidden = self._forward(input_ids, positions, metadata, step)
        last_token_rows = [end - 1 for end in metadata.query_start_loc_cpu[1:]]
        logits = self.model.compute_logits(self._select_rows(hidden, last_token_rows, metadata.num_tokens))
        return logits[:, :vocab_size].argmax(dim=-1).tolist()

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        step: StepInputs,
        stage_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self.model is not None
        plan = self.attention_backend.prepare(metadata)
        if self.lora_manager is not None:
            self.lora_manager.remove(step.removed_lora_ids)
            self.lora_manager.prepare(step.lora_requests, metadata.query_start_loc_cpu)
        model_inputs: dict[str, torch.Tensor] = {}
        if self._rope_sequence_lengths is not None:
            model_inputs["sequence_lengths"] = self._prepare_rope_sequence_lengths(step)
        if stage_input is not None:
            model_inputs["stage_input"] = stage_input
        elif self.encoder_runner is not None:
            embeddings = self.encoder_runner.input_embeddings(input_ids, step, metadata.query_start_loc_cpu)
            if embeddings is not None:
                model_inputs["inputs_embeds"] = embeddings
        return self.model(input_ids, positions, self.kv_caches, plan, **model_inputs)

    def _select_rows(self, hidden: torch.Tensor, rows: list[int], num_tokens: int) -> torch.Tensor:
        if len(rows) == num_tokens:
            return hidden  # every row, in order (rows are increasing)
        indices = self._logits_indices.get(len(rows))
        indices[:] = rows
        selected = hidden.index_select(0, self._logits_indices.to_device(len(rows), self.device))
        self._mark_inputs_copied()
        return selected

    def _prepare_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the previous step's copies must be done before refilling
        if self._cpu_threads is not None:
            self._cpu_threads.use_for(step.total_num_scheduled_tokens)
        num_reqs = step.num_reqs
        num_scheduled = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.asarray(step.num_computed_tokens, dtype=np.int64)
        num_tokens = int(num_scheduled.sum())
        seq_lens = num_computed + num_scheduled
        seq_lens_cpu = seq_lens.tolist()
        max_seq_len = max(seq_lens_cpu)
        if max_seq_len > self.max_model_len:
            raise ValueError(f"a request reaches {max_seq_len} tokens, past max_model_len")

        query_start_loc = self._query_start_loc.get(num_reqs + 1)
        query_start_loc[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        self._seq_lens.get(num_reqs)[:] = seq_lens

        input_ids = self._input_ids.get(num_tokens)
        for i, tokens in enumerate(step.token_ids):
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = tokens

        width = max(len(ids) for ids in step.block_ids)
        block_tables = self._block_tables.get(num_reqs * width).reshape(num_reqs, width)
        block_tables.fill(0)
        for i, ids in enumerate(step.block_ids):
            # Its scheduled tokens are the last of its seq_len: the last one's block must be in the table.
            if len(ids) * self.block_size < seq_lens_cpu[i]:
                raise ValueError("a request's block table is too short for its scheduled tokens")
            block_tables[i, : len(ids)] = ids

        token_request = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = self._positions.get(num_tokens)
        positions[:] = np.arange(num_tokens) + np.repeat(num_computed - query_start_loc[:-1], num_scheduled)
        block_index = positions // self.block_size
        slot_mapping = self._slot_mapping.get(num_tokens)
        slot_mapping[:] = (
            block_tables[token_request, block_index] * self.block_size + positions % self.block_size
        )

        device = self.device
        query_start_loc_cpu = query_start_loc.tolist()
        metadata = AttentionMetadata(
            query_start_loc=self._query_start_loc.to_device(num_reqs + 1, device),
            seq_lens=self._seq_lens.to_device(num_reqs, device),
            block_tables=self._block_tables.to_device(num_reqs * width, device).view(num_reqs, width),
            slot_mapping=self._slot_mapping.to_device(num_tokens, device),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        input_ids_tensor = self._input_ids.to_device(num_tokens, device)
        if not self.model_config.uses_mrope:
            positions_tensor = self._positions.to_device(num_tokens, device)
        else:  # M-RoPE rotates by [3, num_tokens]; the KV slots above follow the token's index
            assert step.mrope_positions is not None, "an M-RoPE model's step needs its requests' positions"
            positions_tensor = torch.from_numpy(np.concatenate(step.mrope_positions, axis=1)).to(device)
        self._mark_inputs_copied()
        return input_ids_tensor, positions_tensor, metadata

    def _prepare_rope_sequence_lengths(self, step: StepInputs) -> torch.Tensor:
        """max(prompt length, position + 1) for each token of the step: the sequence length that Transformers
        rotates it for during generation (the whole prompt at once, then one token at a time)."""
        assert self._rope_sequence_lengths is not None
        num_tokens = step.total_num_scheduled_tokens
        prompt_lengths = np.repeat(step.num_prompt_tokens, step.num_scheduled_tokens)
        lengths = self._rope_sequence_lengths.get(num_tokens)
        np.maximum(prompt_lengths, self._positions.get(num_tokens) + 1, out=lengths)
        tensor = self._rope_sequence_lengths.to_device(num_tokens, self.device)
        self._mark_inputs_copied()
        return tensor

    def _mark_inputs_copied(self) -> None:
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros, resident at once. On the host it is an anonymous mapping the kernel fills in one
    call (MAP_POPULATE): zeroed pages without a page fault each and without a second pass writing zeros. A
    GiB took a quarter less CPU time that way than torch.zeros, and up to half the wall time while other
    processes shared the cores. The tensor keeps the mapping alive; it is unmapped when the tensor goes."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def _release_freed_memory(device: torch.device) -> None:
    """Give what sleep let go of back to the system: the allocator's cached blocks on CUDA; on the host the
    pages glibc keeps for reuse after a free (without this the process's resident memory would not fall)."""
    gc.collect()  # a dropped model's modules refer to each other
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def _thinking_budgets(config: EngineConfig) -> ThinkingBudgets | None:
    """The reasoning's start and end tokens, as the model's tokenizer encodes the reasoning strings; None
    where the engine has none (a request with a thinking_token_budget is then refused)."""
    strings = config.reasoning_strings()
    if strings is None:
        return None
    from kvfleet.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config)
    return ThinkingBudgets(*(tokenizer.encode(text, add_special_tokens=False) for text in strings))
