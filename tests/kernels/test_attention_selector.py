"""Attention backend selection: explicit choices, capability filtering, and the start-up benchmark."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from kvfleet.runtime.attention import selector
from kvfleet.runtime.attention.reference import ReferenceAttentionBackend
from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend
from kvfleet.runtime.attention.selector import select_attention_backend
from kvfleet.runtime.attention.triton_backend import TritonAttentionBackend

CPU_SPEC = selector.AttentionSpec(
    num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=torch.device("cpu")
)

SELECT_ON_CPU = """
import json, sys, torch
from kvfleet.runtime.attention.backend import AttentionSpec
from kvfleet.runtime.attention.selector import select_attention_backend
spec = AttentionSpec(8, 2, 64, 16, torch.bfloat16, torch.device("cpu"))
backend, reason = select_attention_backend(spec, None)
print(json.dumps({"name": backend.name, "reason": reason, "triton_loaded": "triton" in sys.modules}))
"""


def test_a_cpu_machine_gets_sdpa_without_loading_triton() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", selector.ENV_VAR)}
    result = subprocess.run(
        [sys.executable, "-c", SELECT_ON_CPU],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    choice = json.loads(result.stdout)
    assert choice["name"] == "sdpa"
    assert "triton runs on cuda" in choice["reason"]
    assert choice["triton_loaded"] is False


def test_explicit_triton_runs_on_the_cpu_through_the_interpreter(monkeypatch, caplog) -> None:
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    with caplog.at_level(logging.INFO, logger=selector.__name__):
        backend, reason = select_attention_backend(CPU_SPEC, "triton")
    assert backend is TritonAttentionBackend
    assert reason == "requested by the attention_backend option"
    assert "attention backend: triton (requested" in caplog.text


def test_explicit_triton_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"'triton' .* cannot run this model: runs on CUDA devices only"):
        select_attention_backend(CPU_SPEC, "triton")


def test_the_environment_variable_chooses_unless_the_option_does(monkeypatch) -> None:
    monkeypatch.setenv(selector.ENV_VAR, "reference")
    backend, reason = select_attention_backend(CPU_SPEC, None)
    assert backend is ReferenceAttentionBackend and selector.ENV_VAR in reason
    backend, _ = select_attention_backend(CPU_SPEC, "sdpa")
    assert backend is SdpaAttentionBackend


def test_unknown_names_are_refused_with_the_known_ones(monkeypatch) -> None:
    monkeypatch.setenv(selector.ENV_VAR, "flash")
    with pytest.raises(
        ValueError, match=f"unknown attention backend 'flash' \\({selector.ENV_VAR}\\); known: "
    ):
        select_attention_backend(CPU_SPEC, None)


def test_several_candidates_are_benchmarked_and_the_fastest_wins(monkeypatch) -> None:
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    automatic_reference = selector.BackendCapabilities(
        ("cpu",), (torch.float32,), None, 1, (), automatic=True
    )
    monkeypatch.setitem(selector.CAPABILITIES, "reference", automatic_reference)
    timings = {"sdpa": 0.004, "reference": 0.001}
    monkeypatch.setattr(selector, "benchmark_backend", lambda cls, spec, layers: timings[cls.name])
    backend, reason = select_attention_backend(CPU_SPEC, None)
    assert backend is ReferenceAttentionBackend
    assert "sdpa 4.000 ms" in reason and "reference 1.000 ms" in reason

    def failing(cls, spec, layers):
        if cls.name == "reference":
            raise RuntimeError("no kernel image for this device")
        return 0.5

    monkeypatch.setattr(selector, "benchmark_backend", failing)
    backend, _ = select_attention_backend(CPU_SPEC, None)
    assert backend is SdpaAttentionBackend


def test_benchmark_runs_the_backend_on_the_models_shapes(monkeypatch) -> None:
    monkeypatch.setattr(selector, "_DECODE_STEP", [(40, 1)] * 3)
    monkeypatch.setattr(selector, "_MIXED_STEP", [(16, 8), (30, 1)])
    calls = []

    class CountingSdpa(SdpaAttentionBackend):
        def forward(self, query, key, value, kv_cache, plan):
            calls.append((query.shape, kv_cache.shape))
            return super().forward(query, key, value, kv_cache, plan)

    seconds = selector.benchmark_backend(CountingSdpa, CPU_SPEC, num_layers=2, iterations=2)
    assert seconds > 0
    assert len(calls) == 2 * 3 * 2  # 2 steps x (1 warm-up + 2 timed) x 2 layers
    assert calls[0][0] == (3, 4, 64) and calls[-1][0] == (9, 4, 64)
