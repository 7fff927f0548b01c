"""Where a decode step's time goes: each phase of `LLMEngine.step()` timed at a fixed batch size.

The engine is stepped as it serves: `b` requests with short prompts are admitted and prefilled, then every
step is a decode of the whole batch. The timers wrap the engine's own objects (the scheduler's methods, the
runner's pieces, the model's projections and attention backend) for the length of the measurement; nothing in
the engine knows about them. Each phase's time per step is the median over the measured steps, and of several
rounds the one with the fastest whole step is kept, so that a burst of other work on the machine distorts the
figures as little as possible. The timers cost time of their own, so each round first times as many whole
steps without them: the step set against the bound is the lowest of those rounds' medians. A model whose
decoder layers run in one call (`models.cpu_decode_layers`) runs them layer by layer in the timed steps, where
the timers can see each layer's parts, and in one call in the untimed ones. After each round the machine's
read bandwidth is measured on the engine's threads (`bandwidth`), and the highest of the rounds bounds the
step. A mixture-of-experts model's experts are timed apart from its other projections, and the weights a step
reads count those of the experts its tokens were routed to, the median over the measured steps.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from kvfleet.runtime.bench.bandwidth import BandwidthBound, expert_bytes, read_bandwidth, weight_bytes
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.models.layers import Linear
from kvfleet.runtime.models.moe import RoutedExperts
from kvfleet.runtime.quantization.linear import Int8Linear
from kvfleet.runtime.sampling_params import SamplingParams

# Phases in the order of a step. "embedding, norms, rotary, activation" is the model's time less its
# projections, experts and attention; "runner, other" and "output processing" are what is left of their
# parent. "experts": a mixture-of-experts model's routed experts (their projections and activation).
PHASES = (
    "schedule",
    "input preparation",
    "embedding, norms, rotary, activation",
    "projections",
    "experts",
    "attention",
    "logits",
    "sampling",
    "runner, other",
    "update from output",
    "output processing",
)


@dataclass
class StepPhases:
    batch_size: int
    step_ms: float  # without the timers
    timed_step_ms: float  # with them: the sum of the phases
    phase_ms: dict[str, float]
    bound: BandwidthBound
    label: str = ""  # what tells the model apart from others measured beside it


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        # Bytes of the experts that tokens were routed to, since the timers were last cleared.
        self.routed_expert_bytes = 0.0

    def clear(self) -> None:
        self.seconds.clear()
        self.routed_expert_bytes = 0.0

    def count_routed_experts(self, experts: RoutedExperts) -> None:
        """Add the bytes of the experts each call of `experts` routes tokens to (its `sizes` argument)."""
        forward = experts.forward
        per_expert = expert_bytes(experts)
        local = experts.local_experts

        def counted(
            hidden: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, sizes: list[int]
        ) -> torch.Tensor:
            self.routed_expert_bytes += per_expert * sum(
                1 for size in sizes[local.start : local.stop] if size
            )
            return forward(hidden, weights, chosen, sizes)

        experts.forward = counted  # type: ignore[method-assign]

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        """Time every call of owner.attribute under `phase`, through an attribute on the instance."""
        function = getattr(owner, attribute)
        seconds = self.seconds  # cleared, never replaced, between steps

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - start

        setattr(owner, attribute, timed)


class _TimedCallable:
    """Stands in for a callable object (the sampler) whose other attributes the runner also uses."""

    def __init__(self, target: Any, timers: _Timers, phase: str) -> None:
        self._target = target
        self._call = target.__call__
        timers.wrap(self, "_call", phase)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _instrument(llm: LLM, timers: _Timers) -> Callable[[], None]:
    """Put the timers in; returns what takes them out again."""
    engine = llm.llm_engine
    runner = engine.runner
    model = runner.model
    assert model is not None
    wrapped: list[tuple[Any, str]] = []

    def wrap(owner: Any, attribute: str, phase: str) -> None:
        timers.wrap(owner, attribute, phase)
        wrapped.append((owner, attribute))

    wrap(engine, "step", "step")
    wrap(engine.engine_core.scheduler, "schedule", "schedule")
    wrap(engine.engine_core.scheduler, "update_from_output", "update from output")
    wrap(runner, "execute_model", "execute")
    wrap(runner, "_prepare_inputs", "input preparation")
    wrap(runner.attention_backend, "prepare", "input preparation")
    wrap(runner.attention_backend, "forward", "attention")
    wrap(model, "forward", "model")
    wrap(model, "compute_logits", "logits")
    in_experts = set()
    for experts in model.modules():
        if isinstance(experts, RoutedExperts):
            wrap(experts, "expert_mlp", "experts")
            timers.count_routed_experts(experts)
            wrapped.append((experts, "forward"))
            in_experts |= {id(module) for module in experts.modules()}
    for module in model.modules():
        projection = isinstance(module, (Linear, Int8Linear)) and id(module) not in in_experts
        if projection and module is not getattr(model, "lm_head", None):
            wrap(module, "forward", "projections")
    sampler = runner.sampler
    runner.sampler = _TimedCallable(sampler, timers, "sampling")  # type: ignore[assignment]
    # The decoder layers in one call (`models.cpu_decode_layers`) pass the timed modules by: timed steps run
    # the layers one by one, and only the untimed ones as served.
    in_one_call = getattr(model, "cpu_decode_layers", None)
    if in_one_call is not None:
        model.cpu_decode_layers = None

    def remove() -> None:
        for owner, attribute in wrapped:
            delattr(owner, attribute)
        runner.sampler = sampler
        if in_one_call is not None:
            model.cpu_decode_layers = in_one_call

    return remove


def _phases_per_step(seconds: dict[str, float]) -> dict[str, float]:
    ms = {phase: value * 1e3 for phase, value in seconds.items()}
    measured_inside_runner = ms["input preparation"] + ms["model"] + ms["logits"] + ms["sampling"]
    experts = ms.get("experts", 0.0)  # none in a dense model
    return {
        "schedule": ms["schedule"],
        "input preparation": ms["input preparation"],
        "embedding, norms, rotary, activation": ms["model"] - ms["projections"] - experts - ms["attention"],
        "projections": ms["projections"],
        "experts": experts,
        "attention": ms["attention"],
        "logits": ms["logits"],
        "sampling": ms["sampling"],
        "runner, other": ms["execute"] - measured_inside_runner,
        "update from output": ms["update from output"],
        "output processing": ms["step"] - ms["schedule"] - ms["execute"] - ms["update from output"],
    }


def measure_step_phases(
    llm: LLM, batch_size: int, *, steps: int = 100, rounds: int = 3, prompt_len: int = 32, label: str = ""
) -> StepPhases:
    """Phases of a decode step of `batch_size` requests; contexts grow from `prompt_len` tokens."""
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle")
    best: dict[str, float] | None = None  # the medians of the round with the fastest step
    untimed_ms = math.inf
    bandwidth = 0.0
    for round_index in range(rounds):
        params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
        ids = [f"step-phases-{round_index}-{i}" for i in range(batch_size)]
        for i, request_id in enumerate(ids):
            # Distinct prompts: no prefix-cache hits between the requests or the rounds.
            first = 16 + (round_index * batch_size + i) * prompt_len
            prompt = [(first + j) % (engine.vocab_size - 16) + 16 for j in range(prompt_len)]
            engine.add_request(request_id, prompt, params)
        for _ in range(4):  # the prefill, then a few decodes to settle
            engine.step()
        untimed_ms = min(untimed_ms, statistics.median(_step_ms(engine.step) for _ in range(steps)))
        per_step: list[dict[str, float]] = []
        timers = _Timers()
        remove = _instrument(llm, timers)
        try:
            for _ in range(steps):
                engine.step()
                step = {"step": timers.seconds["step"] * 1e3, "expert bytes": timers.routed_expert_bytes}
                per_step.append(_phases_per_step(timers.seconds) | step)
                timers.clear()
        finally:
            remove()
        engine.abort_request(ids)
        bandwidth = max(bandwidth, read_bandwidth())  # on the threads the decode steps just ran on
        medians = {key: statistics.median(step[key] for step in per_step) for key in per_step[0]}
        if best is None or medians["step"] < best["step"]:
            best = medians
    assert best is not None
    timed_ms = best.pop("step")
    bound = _bound(llm, batch_size, prompt_len, steps, bandwidth, best.pop("expert bytes"))
    return StepPhases(batch_size, untimed_ms, timed_ms, best, bound, label)


def _step_ms(step: Callable[[], Any]) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _bound(
    llm: LLM, batch_size: int, prompt_len: int, steps: int, bandwidth: float, routed_expert_bytes: float
) -> BandwidthBound:
    """The bytes of one measured step: the weights (of a mixture-of-experts model's experts, the
    `routed_expert_bytes` its steps read), and the KV of `batch_size` contexts of their mean length over the
    measured steps (the prompt, the four steps before them, and half of the untimed and timed steps)."""
    runner = llm.llm_engine.runner
    model = runner.model
    assert model is not None
    kv_per_token = runner.kv_cache_bytes_per_block() // runner.block_size
    mean_context = prompt_len + 4 + steps
    kv_bytes = round(kv_per_token * mean_context * batch_size)
    has_experts = any(isinstance(module, RoutedExperts) for module in model.modules())
    return BandwidthBound(
        weight_bytes(model, routed_expert_bytes if has_experts else None), kv_bytes, bandwidth
    )


def format_table(results: list[StepPhases]) -> str:
    columns = [f"batch {r.batch_size} {r.label}".rstrip() for r in results]
    header = "| phase (ms per step) | " + " | ".join(columns) + " |"
    lines = [header, "| --- | " + " | ".join("---:" for _ in results) + " |"]
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(f"{r.phase_ms[phase]:.3f}" for r in results) + " |")
    lines.append("| whole step, timed | " + " | ".join(f"{r.timed_step_ms:.3f}" for r in results) + " |")
    lines.append("| **whole step, untimed** | " + " | ".join(f"**{r.step_ms:.3f}**" for r in results) + " |")
    bound_rows = {
        "weights read (MB)": [f"{r.bound.weight_bytes / 1e6:.2f}" for r in results],
        "KV read (MB)": [f"{r.bound.kv_bytes / 1e6:.2f}" for r in results],
        "read bandwidth (GB/s)": [f"{r.bound.bytes_per_second / 1e9:.1f}" for r in results],
        "bound: bytes / bandwidth (ms)": [f"{r.bound.ideal_ms:.3f}" for r in results],
        "**share of the bound**": [f"**{r.bound.share_of(r.step_ms):.0%}**" for r in results],
    }
    lines += [f"| {name} | " + " | ".join(values) + " |" for name, values in bound_rows.items()]
    return "\n".join(lines)
