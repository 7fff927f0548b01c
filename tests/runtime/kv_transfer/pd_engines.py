"""What the tests of disaggregated prefill and decode share: in-process engines on the tiny llama, a prefill
(producer) and a decode (consumer) replica, moving KV blocks over real TCP on loopback."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from kvfleet.contract.kv_transfer import DO_REMOTE_DECODE, PREFILL_MAX_TOKENS
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.core.outputs import SchedulerStats

ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "num_gpu_blocks_override": 64,
    "max_model_len": 256,
}
MAX_TOKENS = 8


def kv_transfer_config(role: str, policy: str = "recompute", **extra_config: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": "TcpConnector",
        "kv_role": role,
        "kv_port": 0,
        "kv_load_failure_policy": policy,
    }
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    return config


def make_llm(model: Path, role: str | None, **options: Any) -> LLM:
    extra = options.pop("extra_config", {})
    policy = options.pop("policy", "recompute")
    config = None if role is None else kv_transfer_config(role, policy, **extra)
    return LLM(str(model), kv_transfer_config=config, **{**ENGINE_OPTIONS, **options})


def shutdown(*llms: LLM) -> None:
    for llm in llms:
        llm.llm_engine.engine_core.shutdown()


def stats(llm: LLM) -> SchedulerStats:
    return llm.llm_engine.engine_core.stats


def free_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_free_blocks


def greedy(max_tokens: int = MAX_TOKENS, kv_transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    extra_args = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)


def prefill(producer: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """vLLM's prefill call: one token, and the params that say where the prompt's blocks wait."""
    outputs = producer.generate(prompts, greedy(PREFILL_MAX_TOKENS, {DO_REMOTE_DECODE: True}))
    params = [output.kv_transfer_params for output in outputs]
    assert all(params), "every prefill call answers with kv_transfer_params"
    return params  # type: ignore[return-value]


def decode(consumer: LLM, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[list[int]]:
    sampling = [greedy(kv_transfer_params=p) for p in params]
    return [output.outputs[0].token_ids for output in consumer.generate(prompts, sampling)]


def release_holds(producer: LLM, timeout_s: float = 10.0) -> None:
    """Step the prefill engine (as its serving loop does) until it holds no block for a pull."""
    deadline = time.monotonic() + timeout_s
    while producer.llm_engine.engine_core.has_pending_kv_transfers():
        assert time.monotonic() < deadline, "the prefill engine still holds blocks"
        producer.llm_engine.step()


def random_prompts(
    count: int, lengths: list[int], seed: int, prefix: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        (prefix or []) + [rng.randrange(16, 500) for _ in range(rng.choice(lengths))] for _ in range(count)
    ]
