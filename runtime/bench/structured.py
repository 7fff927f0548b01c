"""Structured outputs offline: what JSON-schema constraints cost in throughput, and grammar compile times.

The constrained run samples each request under a JSON schema until the schema's value is complete; the
unconstrained run then asks the same prompts for exactly as many tokens each (ignore_eos), so both runs
produce as many tokens in the same batch shapes and differ only in the masking. Runs alternate for a number
of rounds, and each mode's fastest counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.bench.throughput import ThroughputResult
from kvfleet.runtime.bench.workloads import random_requests
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

_TEXT = {"type": "string", "maxLength": 24}
_COUNT = {"type": "integer", "minimum": 0, "maximum": 10000}
# Bounded, so that every answer ends; from one field to nested arrays of objects.
SCHEMAS: dict[str, dict[str, Any]] = {
    "one field": {"type": "object", "properties": {"answer": _TEXT}, "required": ["answer"]},
    "flat record": {
        "type": "object",
        "properties": {
            "name": _TEXT,
            "age": _COUNT,
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "tier": {"enum": ["free", "pro", "team"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "tier", "active"],
    },
    "nested with $defs": {
        "type": "object",
        "properties": {
            "order": {"type": "integer", "minimum": 1, "maximum": 999999},
            "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 4},
            "ship_to": {"$ref": "#/$defs/address"},
        },
        "required": ["order", "lines", "ship_to"],
        "$defs": {
            "line": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": _COUNT,
                },
                "required": ["sku", "quantity"],
            },
            "address": {
                "type": "object",
                "properties": {
                    "street": _TEXT,
                    "city": _TEXT,
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
            },
        },
    },
}


@dataclass
class CompileTime:
    schema: str
    cold_seconds: float
    cached_seconds: float


@dataclass
class StructuredReport:
    constrained: ThroughputResult
    unconstrained: ThroughputResult
    compile_times: list[CompileTime]
    # Mean time a step spent filling and applying the masks, in the constrained runs.
    mask_seconds_per_step: float
    rounds: int
    # CPU time of the process (all its threads) during the fastest runs: what the machine's other work
    # does not change as much as it does the wall time.
    constrained_cpu_seconds: float
    unconstrained_cpu_seconds: float


@dataclass
class _Run:
    seconds: float
    cpu_seconds: float


def _timed(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[_Run, list[RequestOutput]]:
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    return _Run(time.perf_counter() - start, time.process_time() - cpu_start), outputs


def run_structured(
    model_path: str,
    *,
    num_requests: int,
    rounds: int,
    engine_options: dict,
    seed: int,
    log: Callable[[str], None],
) -> StructuredReport:
    llm = LLM(model_path, **engine_options)
    core = llm.llm_engine.engine_core
    compiler = core.structured_outputs.compiler
    log("preparing the vocabulary for grammars")
    compiler.compile(StructuredOutputsParams(regex="warm-up")).result()
    compile_times = []
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema)).result()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema)).result()
        compile_times.append(CompileTime(name, cold, time.perf_counter() - start))
        log(f"compiled {name!r} in {cold * 1000:.1f} ms")

    requests = random_requests(num_requests, (16, 256), (1, 1), llm.llm_engine.vocab_size, seed=seed)
    prompts = [request.prompt_token_ids for request in requests]
    schemas = list(SCHEMAS.values())
    constrained_params = [
        SamplingParams(
            temperature=1.0,
            seed=seed + index,
            max_tokens=512,
            structured_outputs=StructuredOutputsParams(json=schemas[index % len(schemas)]),
        )
        for index in range(num_requests)
    ]
    log("warming up")
    llm.generate(prompts[:4], constrained_params[:4], use_tqdm=False)
    constrained: list[_Run] = []
    free: list[_Run] = []
    mask_steps = 0
    mask_seconds = 0.0
    # Alternating rounds, each mode's fastest kept: on a shared machine one run of each is mostly noise.
    for round_number in range(1, rounds + 1):
        stats = core.stats
        steps_before, seconds_before = stats.grammar_mask_steps, stats.grammar_mask_seconds
        log(f"round {round_number}/{rounds}: {num_requests} requests under JSON schemas")
        run, outputs = _timed(llm, prompts, constrained_params)
        stats = core.stats
        mask_steps += stats.grammar_mask_steps - steps_before
        mask_seconds += stats.grammar_mask_seconds - seconds_before
        lengths = [len(output.outputs[0].token_ids) for output in outputs]
        constrained.append(run)
        log(f"round {round_number}/{rounds}: the same requests unconstrained, for as many tokens each")
        free_params = [
            SamplingParams(temperature=1.0, seed=seed + index, max_tokens=length, ignore_eos=True)
            for index, length in enumerate(lengths)
        ]
        run, free_outputs = _timed(llm, prompts, free_params)
        free.append(run)
    free_tokens = sum(len(output.outputs[0].token_ids) for output in free_outputs)
    best_constrained = min(constrained, key=lambda run: run.seconds)
    best_free = min(free, key=lambda run: run.seconds)
    return StructuredReport(
        ThroughputResult("JSON schema", best_constrained.seconds, sum(lengths)),
        ThroughputResult("unconstrained", best_free.seconds, free_tokens),
        compile_times,
        mask_seconds / mask_steps if mask_steps else 0.0,
        rounds,
        best_constrained.cpu_seconds,
        best_free.cpu_seconds,
    )
