"""A worker process: one rank of a tensor- and pipeline-parallel model.

It joins the torch.distributed group (gloo on the CPU, NCCL on CUDA, plus a gloo group for nothing but the
rendezvous), loads its shard of the weights, tells the engine core it is ready, then runs what the core sends
over its ZeroMQ socket: KV cache allocation, steps, and sleep mode's sleep and wake-up. Every rank runs every
step; the last stage's first tensor-parallel rank sends the step's logits back, the others an empty answer (so
that the core knows each rank has finished the step, and hears of a rank's error).

It exits when its parent (the engine core, or on another node the process that started it) exits, when its
connection to the core breaks, or when a collective fails or times out (COLLECTIVE_TIMEOUT): a broken group
never leaves a rank waiting forever. A rank that cannot load tells the core why and waits to be stopped, a
minute at most.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist
import zmq
from kvfleet.runtime.child_process import child_arguments, exit_with_parent
from kvfleet.runtime.distributed.parallel import COLLECTIVE_TIMEOUT, ParallelContext, set_parallel_context
from kvfleet.runtime.executor.messages import StepDone, WorkerLoadFailed, WorkerReady, WorkerSpec
from kvfleet.runtime.worker.model_runner import ModelRunner
from kvfleet.runtime.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# How long ranks wait for each other to join the group (nodes start at different times).
_JOIN_TIMEOUT = datetime.timedelta(minutes=15)
# How long a rank that could not load waits for the core to read why and stop it.
_REASON_DELIVERY_S = 60.0


def run_worker(spec: WorkerSpec, parent_pid: int, ready_fd: int | None) -> None:
    """The process's target. `ready_fd`: a pipe that gets one byte once the shard is loaded and the KV
    cache allocated, for the process that watches this node's workers."""
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s %(levelname)s %(name)s [rank {spec.rank}]: %(message)s"
    )
    exit_with_parent(parent_pid)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, spec.rank.to_bytes(4, "big"))
    socket.setsockopt(zmq.LINGER, 1000)
    _exit_on_disconnect(socket)
    socket.connect(spec.core_address)
    try:
        runner = _join_and_load(spec)
    except Exception as exc:
        logger.exception("loading failed")
        socket.send(pickle.dumps(WorkerLoadFailed(spec.rank, f"{type(exc).__name__}: {exc}")))
        # The core stops every rank once it has read why: exiting now could reach it before the reason. A
        # core that never reads it (gone before this rank joined) does not keep the rank waiting for it.
        time.sleep(_REASON_DELIVERY_S)
        os._exit(1)
    socket.send(
        pickle.dumps(
            WorkerReady(
                rank=spec.rank,
                kv_cache_bytes_per_block=runner.kv_cache_bytes_per_block(),
                kv_cache_budget_bytes=runner.kv_cache_budget_bytes(),
                parameter_bytes=runner.load_stats.parameter_bytes,
                peak_load_buffer_bytes=runner.load_stats.peak_buffer_bytes,
            )
        )
    )
    sends_logits = runner.parallel.is_last_stage and runner.parallel.tp_rank == 0
    reports_expert_load = runner.parallel.tp_rank == 0
    while True:
        kind, argument = pickle.loads(socket.recv())
        done = StepDone(spec.rank)
        logits = None
        try:
            if kind == "kv_cache":
                runner.initialize_kv_cache(argument)  # type: ignore[arg-type]
                if ready_fd is not None:
                    os.write(ready_fd, b"1")
            elif kind == "host_kv_tier":
                runner.initialize_host_kv_tier(argument)  # type: ignore[arg-type]
            elif kind == "sleep":
                runner.sleep(argument)  # type: ignore[arg-type]
            elif kind == "wake_up":
                runner.wake_up(argument)  # type: ignore[arg-type]
            else:
                assert isinstance(argument, StepInputs)
                logits = runner.compute_logits(argument)
                if reports_expert_load:
                    done.expert_load = runner.expert_load()
        except Exception as exc:
            if _is_group_failure(exc):
                logger.exception("a collective failed: the group is broken")
                os._exit(1)
            # The same input fails on every rank before any collective; a failure on one rank alone leaves
            # the others in a collective that times out, and the group ends.
            logger.exception("%s failed", kind)
            done.error = f"{type(exc).__name__}: {exc}"
        if sends_logits and logits is not None:
            done.logits_shape = tuple(logits.shape)
            socket.send_multipart((pickle.dumps(done), logits.float().cpu().numpy().tobytes()))
        else:
            socket.send_multipart((pickle.dumps(done),))


def _is_group_failure(exc: Exception) -> bool:
    """A failed or timed-out collective (NCCL's errors have their type; gloo's are RuntimeErrors from its
    transport)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def _join_and_load(spec: WorkerSpec) -> ModelRunner:
    config = spec.config
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    world_size = tp_size * pp_size
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(spec.local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # The node's CPUs are shared by its ranks (the runner keeps to a thread count set this way).
        local_ranks = world_size // config.nnodes
        threads = max(1, len(os.sched_getaffinity(0)) // local_ranks)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    store: dist.Store
    if spec.rendezvous_file is not None:
        store = dist.FileStore(spec.rendezvous_file, world_size)
        store.set_timeout(_JOIN_TIMEOUT)
    else:
        store = dist.TCPStore(
            config.master_addr,
            config.master_port,
            world_size,
            is_master=spec.rank == 0,
            timeout=_JOIN_TIMEOUT,
        )
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=spec.rank, world_size=world_size, timeout=_JOIN_TIMEOUT
    )
    # Once everyone has joined, collectives run in groups with a short timeout. Every rank creates every
    # group, in the same order.
    world = dist.new_group(list(range(world_size)), timeout=COLLECTIVE_TIMEOUT)
    tp_group = world
    for stage in range(pp_size):
        group = dist.new_group(
            list(range(stage * tp_size, (stage + 1) * tp_size)), timeout=COLLECTIVE_TIMEOUT
        )
        if stage == spec.rank // tp_size:
            tp_group = group
    set_parallel_context(
        ParallelContext(
            tp_size=tp_size,
            pp_size=pp_size,
            rank=spec.rank,
            enable_expert_parallel=config.enable_expert_parallel,
            tp_group=tp_group,
            world_group=world,
        )
    )
    runner = ModelRunner(config)
    runner.load_model()
    logger.info(
        "rank %d of %d (tp %d/%d, stage %d/%d) loaded: %.1f MiB of parameters, load buffer at most %.1f MiB",
        spec.rank,
        world_size,
        runner.parallel.tp_rank,
        tp_size,
        runner.parallel.pp_rank,
        pp_size,
        runner.load_stats.parameter_bytes / 2**20,
        runner.load_stats.peak_buffer_bytes / 2**20,
    )
    return runner


def _exit_on_disconnect(socket: zmq.Socket) -> None:
    """A thread that ends the process when the connection to the engine core breaks (its node is gone)."""
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def watch() -> None:
        monitor.recv_multipart()
        logger.error("the connection to the engine core is lost; stopping")
        os._exit(1)

    threading.Thread(target=watch, name="core-watch", daemon=True).start()


if __name__ == "__main__":
    run_worker(*child_arguments())
