"""What the engine core and its worker processes send each other (pickled: the classes live here, not in the
worker's __main__ module, so that both sides name them alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.models.moe_config import MoeLayerLoad


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with."""

    config: EngineConfig
    rank: int
    local_rank: int
    core_address: str
    log_level: int
    # Where ranks on one node meet (a FileStore); None when they meet over TCP on master_port.
    rendezvous_file: str | None


@dataclass
class WorkerReady:
    rank: int
    kv_cache_bytes_per_block: int
    # Bytes of memory the KV cache may take on this rank.
    kv_cache_budget_bytes: float
    # What loading held: the rank's parameters, and the largest slice read from the checkpoint at once.
    parameter_bytes: int
    peak_load_buffer_bytes: int


@dataclass
class WorkerLoadFailed:
    """A rank that could not join its group or load its shard, and why (its exit status would not say)."""

    rank: int
    error: str


@dataclass
class StepDone:
    rank: int
    # Why the step failed on this rank, or None.
    error: str | None = None
    # The step's logits (float32), from the rank that sends them.
    logits_shape: tuple[int, ...] | None = None
    # The expert load of the mixture-of-experts layers of the rank's stage, from its first tensor-parallel
    # rank (the router is whole on every rank, so each counts what all of them route).
    expert_load: list[MoeLayerLoad] = field(default_factory=list)


# What the core sends: ("kv_cache", blocks), ("host_kv_tier", blocks), ("step", StepInputs), ("sleep", level)
# or ("wake_up", tags).
WorkerCommand = tuple[str, object]
