"""Executors: how the engine core's steps reach the model. Bound once, when the core is built.

- UniProcExecutor (tensor_parallel_size = pipeline_parallel_size = 1): the ModelRunner in the core's own
  process runs the model and samples, as it always has.
- MultiprocExecutor (`distributed_executor_backend` mp): one worker process per rank of this node
  (worker_proc.py), each with a ModelRunner over its shard. The scheduler stays in the core; each step goes to
  every rank, the last pipeline stage's first tensor-parallel rank sends back the logits of the rows that
  sample, and the core's own ModelRunner, which holds no weights, samples them.

Why the core samples instead of the ranks: sampling reads state that lives with the scheduler's requests
(grammar matchers, seeded generators, penalties, drafts to verify). Kept in one process it needs neither
copies on every rank nor a protocol for ranks to agree, and every sampling feature works the same at any
size; the price is the sampled rows' logits crossing a socket once a step (rows x vocabulary x 4 bytes).

The core watches its local workers through pidfds: a worker that exits (killed, or ended by a failed or
timed-out collective) fails the step with WorkerFailedError, which ends the core, and with it the server. Over
several nodes it also watches the connections of the other nodes' workers: one that drops (its node stopped or
died) ends the core the same way, even while idle, when no collective would notice.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import tempfile
import weakref
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
import zmq
from kvfleet.runtime.child_process import describe_exit, start_child
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvfleet.runtime.distributed.parallel import check_devices, check_model_fits
from kvfleet.runtime.executor.messages import (
    StepDone,
    WorkerCommand,
    WorkerLoadFailed,
    WorkerReady,
    WorkerSpec,
)
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.models.loader import resolve_device
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe_config import MoeLayerLoad
from kvfleet.runtime.worker.model_runner import ModelRunner
from kvfleet.runtime.worker.step_inputs import StepInputs
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 5.0


class WorkerFailedError(RuntimeError):
    """A worker process exited: the group is broken and the engine cannot go on."""


class Executor(ABC):
    """The engine core's one way to the model: what it needs to know of the model as loaded, and the calls
    that size the KV cache, run steps and load adapters. The core never reaches the model runner."""

    def __init__(self, runner: ModelRunner) -> None:
        # Samples; with one rank it runs the model as well.
        self.runner = runner
        self.model_config = runner.model_config
        self.max_model_len: int = runner.max_model_len
        self.vocab_size: int = runner.vocab_size
        self.device = runner.device
        self.dtype = runner.dtype
        self.attention_backend: str = runner.attention_backend.name

    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes on each rank."""

    @abstractmethod
    def kv_cache_budget_bytes(self) -> float:
        """Memory the KV cache may take on the rank that has least of it."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def initialize_host_kv_tier(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def sleep(self, level: int) -> None:
        """Free the KV cache on every rank, and the weights too at level 2 (ModelRunner.sleep)."""

    @abstractmethod
    def wake_up(self, tags: list[str]) -> None:
        """Take back on every rank what sleep freed, of "weights" and "kv_cache"."""

    def add_lora(self, lora: LoRARequest) -> None:
        """Have the adapter ready to run; raises LoRAAdapterError when it cannot run on this model. LoRA runs
        on one rank, in this process (the config allows no other)."""
        lora_manager = self.runner.lora_manager
        assert lora_manager is not None, "LoRA is enabled on one rank only"
        lora_manager.add(lora)

    def fill_stats(self, stats: SchedulerStats) -> None:
        """Add the sampler's grammar-mask counters, the encoder runner's, the KV transport's and the experts'
        load to the step's stats."""
        stats.moe_layer_load = self.expert_load()
        masks = self.runner.sampler.grammar_masks
        stats.grammar_mask_steps = masks.num_steps
        stats.grammar_mask_seconds = masks.seconds
        encoders = self.runner.encoder_runner
        if encoders is not None:
            stats.encoder_runs = encoders.num_encoder_runs
            stats.encoder_cache_hits = encoders.num_cache_hits
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.fill_stats(stats)

    def expert_load(self) -> list[MoeLayerLoad]:
        """The routing load of the model's mixture-of-experts layers, by layer."""
        return self.runner.expert_load()

    def kv_connector_handshake_metadata(self) -> dict[str, Any]:
        """What the KV connector's worker side tells its scheduler side once its transport is up (one rank
        only: the config allows no other)."""
        connector = self.runner.kv_connector
        return {} if connector is None else connector.get_handshake_metadata()

    def wait_for_kv_transfers(self, timeout: float) -> None:
        """Return when a KV load ends, or after timeout."""
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.wait(timeout)

    @property
    def worker_watches(self) -> list[int | zmq.Socket]:
        """What becomes readable when a worker is lost, for a zmq.Poller: pidfds of local worker processes,
        the monitor of other nodes' connections; none in-process."""
        return []

    def check_workers(self) -> None:  # noqa: B027 (nothing to check in-process)
        """Raises WorkerFailedError if a worker process has exited."""

    def shutdown(self) -> None:  # noqa: B027 (a default: subclasses stop what they started)
        """Stop what the executor started: worker processes, the KV connector's transport."""


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, *, reserved_cpus: int = 0) -> None:
        runner = ModelRunner(config, reserved_cpus=reserved_cpus)
        runner.load_model()
        super().__init__(runner)

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def kv_cache_budget_bytes(self) -> float:
        return self.runner.kv_cache_budget_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def initialize_host_kv_tier(self, num_blocks: int) -> None:
        self.runner.initialize_host_kv_tier(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.runner.wake_up(tags)

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        check_parallel_config(config)
        # No weights here: this runner samples what the workers compute.
        super().__init__(ModelRunner(config))
        self.world_size = config.world_size
        local_ranks = self.world_size // config.nnodes
        self._socket_dir = tempfile.mkdtemp(prefix="kvfleet-workers-")
        rendezvous_file = None
        if config.nnodes == 1:
            address = f"ipc://{self._socket_dir}/workers.sock"
            bind = address
            # A file, not a fixed port: two engines on one host would otherwise collide on the port.
            rendezvous_file = f"{self._socket_dir}/rendezvous"
        else:
            # Workers on the other nodes connect to node 0 on the port after the rendezvous's.
            address = f"tcp://{config.master_addr}:{config.master_port + 1}"
            bind = f"tcp://*:{config.master_port + 1}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        # A dropped connection is a lost rank: another node's workers never reconnect (they exit with it).
        self._disconnects = (
            self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) if config.nnodes > 1 else None
        )
        self.workers = start_workers(config, range(local_ranks), address, rendezvous_file=rendezvous_file)
        self._pidfds = {os.pidfd_open(worker.pid): worker for worker in self.workers}
        # Stops the workers however this object goes (garbage, interpreter exit) unless shutdown() ran.
        self._finalizer = weakref.finalize(self, _stop, self.workers, self._socket_dir)
        try:
            ready = [self._ready_rank() for _ in range(self.world_size)]
        except BaseException:
            self.shutdown()
            raise
        self.ready = sorted(ready, key=lambda r: r.rank)
        # Each stage's latest report of its layers' expert load.
        self._expert_load: dict[int, MoeLayerLoad] = {}
        self._identities = [rank.to_bytes(4, "big") for rank in range(self.world_size)]
        logger.info(
            "%d ranks ready (tp %d x pp %d over %d nodes); parameters per rank: %s MiB",
            self.world_size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.nnodes,
            ", ".join(f"{r.parameter_bytes / 2**20:.1f}" for r in self.ready),
        )

    def kv_cache_bytes_per_block(self) -> int:
        return max(r.kv_cache_bytes_per_block for r in self.ready)

    def kv_cache_budget_bytes(self) -> float:
        return min(r.kv_cache_budget_bytes for r in self.ready)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._run(("kv_cache", num_blocks))

    def initialize_host_kv_tier(self, num_blocks: int) -> None:
        self._run(("host_kv_tier", num_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        step = StepInputs.of(scheduler_output)
        speculative = self.runner.prepare_sampling(scheduler_output, step)
        logits = self._run(("step", step))
        return self.runner.sample(scheduler_output, step, speculative, logits)

    def sleep(self, level: int) -> None:
        self._run(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self._run(("wake_up", tags))

    def _run(self, command: WorkerCommand) -> torch.Tensor | None:
        """Send a command to every rank and wait for all of them; the logits, if a rank sent them."""
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for identity in self._identities:
            self._socket.send_multipart((identity, payload), copy=False)
        logits = None
        errors = []
        for _ in range(self.world_size):
            done, frames = self._receive()
            assert isinstance(done, StepDone)
            if done.error is not None:
                errors.append(f"rank {done.rank}: {done.error}")
            self._expert_load.update((load.layer, load) for load in done.expert_load)
            if done.logits_shape is not None:
                array = np.frombuffer(frames[0], dtype=np.float32).reshape(done.logits_shape)
                logits = torch.from_numpy(array.copy()).to(self.runner.device)
        if errors:
            raise RuntimeError("; ".join(errors))
        return logits

    def expert_load(self) -> list[MoeLayerLoad]:
        return [self._expert_load[layer] for layer in sorted(self._expert_load)]

    @property
    def worker_watches(self) -> list[int | zmq.Socket]:
        watches: list[int | zmq.Socket] = list(self._pidfds)
        if self._disconnects is not None:
            watches.append(self._disconnects)
        return watches

    def check_workers(self) -> None:
        for worker in self._pidfds.values():
            if worker.poll() is not None:
                raise WorkerFailedError(f"worker process {worker.pid} {describe_exit(worker.returncode)}")
        if self._disconnects is not None and self._disconnects.poll(0):
            event = recv_monitor_message(self._disconnects)
            endpoint = event["endpoint"].decode()
            raise WorkerFailedError(f"a worker's connection to {endpoint} dropped: a rank is gone")

    def _ready_rank(self) -> WorkerReady:
        """The next rank's report that it has loaded its shard; WorkerFailedError with its reason when a
        rank could not."""
        message, _ = self._receive()
        if isinstance(message, WorkerLoadFailed):
            raise WorkerFailedError(f"rank {message.rank} could not load the model: {message.error}")
        assert isinstance(message, WorkerReady), message
        return message

    def _receive(self) -> tuple[object, list[bytes]]:
        """The next message from a rank (its header, unpickled, and any further frames). Raises
        WorkerFailedError when a worker is lost first."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        for watch in self.worker_watches:
            poller.register(watch, zmq.POLLIN)
        events = dict(poller.poll())
        if self._socket not in events:
            self.check_workers()
        _, header, *frames = self._socket.recv_multipart()
        return pickle.loads(header), frames

    def shutdown(self) -> None:
        for pidfd in self._pidfds:
            os.close(pidfd)
        self._pidfds = {}
        self._finalizer()
        if self._disconnects is not None:
            self._socket.disable_monitor()
            self._disconnects.close(linger=0)
            self._disconnects = None
        self._socket.close(linger=0)
        self._context.term()


def check_parallel_config(config: EngineConfig) -> None:
    """Raises ValueError, naming the numbers, when the model or this node cannot take the split asked for."""
    model_config = ModelConfig.from_folder(config.model, config.hf_overrides)
    check_model_fits(
        model_config,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        enable_expert_parallel=config.enable_expert_parallel,
    )
    check_devices(config.world_size // config.nnodes, resolve_device(config.device).type)


def start_workers(
    config: EngineConfig,
    local_ranks: range,
    core_address: str,
    *,
    rendezvous_file: str | None = None,
    ready_fds: list[int] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """One worker process per local rank of this node (global rank = node_rank x local ranks + local rank)."""
    first = config.node_rank * len(local_ranks)
    log_level = logging.getLogger().getEffectiveLevel()
    workers = []
    for local_rank in local_ranks:
        spec = WorkerSpec(config, first + local_rank, local_rank, core_address, log_level, rendezvous_file)
        ready_fd = None if ready_fds is None else ready_fds[local_rank]
        workers.append(
            start_child(
                "kvfleet.runtime.executor.worker_proc",
                (spec, os.getpid(), ready_fd),
                pass_fds=() if ready_fd is None else (ready_fd,),
            )
        )
    return workers


def stop_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL those still running after a while; waits for every one."""
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    for worker in workers:
        try:
            worker.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _stop(workers: list[subprocess.Popen[bytes]], socket_dir: str) -> None:
    stop_workers(workers)
    shutil.rmtree(socket_dir, ignore_errors=True)


def make_executor(config: EngineConfig, *, reserved_cpus: int = 0) -> Executor:
    if config.world_size == 1:
        return UniProcExecutor(config, reserved_cpus=reserved_cpus)
    return MultiprocExecutor(config)
