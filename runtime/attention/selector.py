"""Chooses the attention backend an engine runs with.

An explicit choice (the `attention_backend` option, else the KVFLEET_ATTENTION_BACKEND variable) is taken
as is, or refused with the backend's reason. Otherwise every automatic backend whose declared capabilities
fit the model on this device is asked whether it can run it; when several can, a short benchmark on the
model's own attention shapes picks the fastest. Capabilities are checked before a backend is imported, so
a CPU-only machine never loads Triton unless asked to (the interpreter is for tests).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.registry import BACKENDS, load_backend_class, unsupported_reason

logger = logging.getLogger(__name__)

ENV_VAR = "KVFLEET_ATTENTION_BACKEND"


@dataclass(frozen=True)
class BackendCapabilities:
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None  # None: any
    head_dim_multiple: int
    features: tuple[str, ...]
    # Chosen without being asked for; the reference backend is for checking the others, not for serving.
    automatic: bool

    def mismatch(self, spec: AttentionSpec) -> str | None:
        if spec.device.type not in self.devices:
            return f"runs on {', '.join(self.devices)}, not {spec.device.type}"
        if spec.dtype not in self.dtypes:
            return f"does not support {spec.dtype}"
        too_big = self.max_head_dim is not None and spec.head_dim > self.max_head_dim
        if too_big or spec.head_dim % self.head_dim_multiple:
            return f"does not support head size {spec.head_dim}"
        return None


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_PAGED_FEATURES = ("paged-kv", "mixed-prefill-decode", "prefix-caching", "gqa")

# In order of preference when a benchmark cannot separate them.
CAPABILITIES: dict[str, BackendCapabilities] = {
    "triton": BackendCapabilities(("cuda",), _FLOATS, 256, 16, (*_PAGED_FEATURES, "split-kv"), True),
    "sdpa": BackendCapabilities(("cpu", "cuda"), _FLOATS, None, 1, _PAGED_FEATURES, True),
    "reference": BackendCapabilities(("cpu", "cuda"), _FLOATS, None, 1, _PAGED_FEATURES, False),
}


def select_attention_backend(
    spec: AttentionSpec, requested: str | None, *, num_layers: int = 32
) -> tuple[type[AttentionBackend], str]:
    """The backend class to run `spec` with, and a sentence saying why it was chosen (also logged).

    `num_layers` weighs a backend's per-step `prepare` against its per-layer `forward` in the benchmark.
    """
    name, reason = _choose(spec, requested, num_layers)
    logger.info("attention backend: %s (%s)", name, reason)
    return load_backend_class(name), reason


def _choose(spec: AttentionSpec, requested: str | None, num_layers: int) -> tuple[str, str]:
    source = "attention_backend option"
    if not requested:
        requested, source = os.environ.get(ENV_VAR) or None, ENV_VAR
    if requested:
        if requested not in BACKENDS:
            known = ", ".join(BACKENDS)
            raise ValueError(f"unknown attention backend {requested!r} ({source}); known: {known}")
        # An explicit choice is judged by the backend alone: Triton may run on the CPU in its interpreter.
        reason = unsupported_reason(requested, spec)
        if reason is not None:
            raise ValueError(f"attention backend {requested!r} ({source}) cannot run this model: {reason}")
        return requested, f"requested by the {source}"

    rejected: dict[str, str] = {}
    candidates: list[str] = []
    for name, capabilities in CAPABILITIES.items():
        if not capabilities.automatic:
            continue
        reason = capabilities.mismatch(spec) or unsupported_reason(name, spec)
        if reason is None:
            candidates.append(name)
        else:
            rejected[name] = reason
    why_not = "; ".join(f"{name} {reason}" for name, reason in rejected.items())
    if not candidates:
        reason = unsupported_reason("reference", spec)
        if reason is not None:
            raise ValueError(f"no attention backend can run this model: {why_not}; reference {reason}")
        return "reference", f"no faster backend supports this model ({why_not})"
    if len(candidates) == 1:
        return candidates[0], "the only automatic backend that supports this model" + (
            f" ({why_not})" if why_not else ""
        )
    timings: dict[str, float] = {}
    for name in candidates:
        try:
            timings[name] = benchmark_backend(load_backend_class(name), spec, num_layers)
        except Exception as exc:  # a backend that fails on this device must not stop the engine
            logger.warning("attention backend %s failed its start-up benchmark: %r", name, exc)
            rejected[name] = f"failed its benchmark ({type(exc).__name__})"
    if not timings:
        raise RuntimeError(f"every attention backend failed its start-up benchmark: {rejected}")
    fastest = min(timings, key=timings.__getitem__)
    measured = ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in timings.items())
    return fastest, f"fastest on this model's attention shapes per {num_layers}-layer step: {measured}"


# The benchmark's steps: a decode batch, and a prefill chunk over a cached prefix beside a few decodes.
_DECODE_STEP = [(1024, 1)] * 32
_MIXED_STEP = [(512, 256)] + [(1024, 1)] * 15


def benchmark_backend(
    backend_class: type[AttentionBackend], spec: AttentionSpec, num_layers: int, iterations: int = 5
) -> float:
    """Median seconds of one step's `prepare` plus `num_layers` forwards, summed over the benchmark steps."""
    backend = backend_class(spec)
    total = 0.0
    for step in (_DECODE_STEP, _MIXED_STEP):
        inputs = _synthetic_step(spec, step)
        samples = []
        for iteration in range(iterations + 1):
            _synchronize(spec.device)
            start = time.perf_counter()
            plan = backend.prepare(inputs.metadata)
            for _ in range(num_layers):
                backend.forward(inputs.query, inputs.key, inputs.value, inputs.kv_cache, plan)
            _synchronize(spec.device)
            if iteration:  # the first one compiles and warms caches
                samples.append(time.perf_counter() - start)
        total += statistics.median(samples)
        del inputs
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    return total


@dataclass
class _StepInputs:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata


def _synthetic_step(spec: AttentionSpec, step: list[tuple[int, int]]) -> _StepInputs:
    """Random inputs for a step of (cached tokens, new tokens) per request, blocks laid out in order."""
    device, block_size = spec.device, spec.block_size
    seq_lens = [cached + new for cached, new in step]
    blocks_per_request = [-(-seq_len // block_size) for seq_len in seq_lens]
    max_blocks = max(blocks_per_request)
    block_tables = torch.zeros((len(step), max_blocks), dtype=torch.int32)
    slots: list[int] = []
    next_block = 0
    for request, ((cached, new), num_blocks) in enumerate(zip(step, blocks_per_request, strict=True)):
        block_tables[request, :num_blocks] = torch.arange(next_block, next_block + num_blocks)
        slots.extend(next_block * block_size + position for position in range(cached, cached + new))
        next_block += num_blocks
    query_start_loc = [0]
    for _, new in step:
        query_start_loc.append(query_start_loc[-1] + new)
    num_tokens = query_start_loc[-1]

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=spec.dtype, device=device)

    kv_shape = (2, next_block, block_size, spec.num_kv_heads, spec.head_dim)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(new for _, new in step),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return _StepInputs(
        query=random(num_tokens, spec.num_heads, spec.head_dim),
        key=random(num_tokens, spec.num_kv_heads, spec.head_dim),
        value=random(num_tokens, spec.num_kv_heads, spec.head_dim),
        kv_cache=random(*kv_shape),
        metadata=metadata,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
