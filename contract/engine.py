"""The engine's choices that the operator renders into a replica's flags: `--scheduling-policy`, `--dtype`
and `--quantization` take exactly these values; and the runtime that serves the replicas."""

from __future__ import annotations

from typing import Literal, get_args

# kvfleet: `kvfleet serve`, this project's runtime; vllm: `vllm serve`, vLLM's own server, with the flags
# both share (kvfleet's runtime keeps vLLM's names) and none of kvfleet's own.
Runtime = Literal["kvfleet", "vllm"]
RUNTIMES: tuple[Runtime, ...] = get_args(Runtime)

# fcfs: arrival order; priority: lower priority value first, preempting less urgent requests.
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)

# auto: the dtype of the model's config.json.
DType = Literal["auto", "float32", "float16", "bfloat16"]
DTYPES: tuple[DType, ...] = get_args(DType)

# vLLM's `--quantization` names of the checkpoint formats kvfleet's runtime loads (weight-only int8, int4 and
# float8 in compressed-tensors' layout); it refuses vLLM's other names with the reason.
LOADED_QUANTIZATION_METHODS = ("compressed-tensors",)


def preempts(policy: SchedulingPolicy) -> bool:
    """Whether a replica under `policy` makes room for an urgent request by preempting less urgent ones
    (a first-come, first-served replica never does)."""
    return policy == "priority"
