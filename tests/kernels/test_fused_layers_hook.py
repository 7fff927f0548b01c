"""The fused implementations the model's layers bind agree with those layers' torch code: Triton's kernels
(run here by its interpreter) and, for float32 on the CPU, the C++ operations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from kvfleet.runtime.kernels import fused_layers
from kvfleet.runtime.models import layers

ROPE = {"rope_theta": 10000.0}


def fused(layer: fused_layers.CustomOp, dtype: torch.dtype) -> Callable:
    """The layer's C++ operation for float32 on the CPU, its Triton kernel (interpreted here) otherwise."""
    return layer.forward_cpu if dtype == torch.float32 else layer.forward_cuda


def fused_for(x: torch.Tensor) -> bool:
    """Whether a layer built for x's device and dtype binds a fused implementation."""
    return fused_layers.implementation_for(x.device, x.dtype) is not fused_layers.Implementation.NATIVE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [6, 70])  # a decode step's few rows, and enough to be split over threads
def test_rms_norm_matches_the_model_layer(assert_close, dtype, with_residual, rows) -> None:
    generator = torch.Generator().manual_seed(1)
    layer = layers.RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.1 * torch.randn(96, generator=generator))
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    residual = torch.randn(rows, 96, generator=generator).to(dtype) if with_residual else None

    out, new_residual = fused(layer, dtype)(x, residual)
    expected_out, expected_residual = layer.forward_native(x, residual)

    assert_close(out, expected_out)
    assert_close(new_residual, expected_residual)


def test_rms_norm_takes_a_residual_that_is_a_strided_view(assert_close) -> None:
    layer = layers.RMSNorm(64, 1e-6)
    x = torch.randn(5, 64)
    residual = torch.randn(64, 5).t()
    out, new_residual = fused(layer, torch.float32)(x, residual)
    expected_out, expected_residual = layer.forward_native(x, residual)
    assert_close(out, expected_out)
    assert_close(new_residual, expected_residual)


def test_rms_norm_of_per_head_rows_keeps_the_shape(assert_close) -> None:
    # Qwen3's q/k norm normalises each head of a [tokens, heads, head_dim] view of the QKV output.
    layer = layers.RMSNorm(64, 1e-6)
    qkv = torch.randn(5, 3 * 4 * 64)
    query = qkv[:, : 4 * 64].view(5, 4, 64)
    out, _ = fused(layer, torch.float32)(query)
    assert out.shape == query.shape
    assert_close(out, layer.forward_native(query)[0])


LENGTH_DEPENDENT_ROPES = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 32 for i in range(32)],
        "long_factor": [1.0 + i / 4 for i in range(32)],
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("rope_type", ["default", *LENGTH_DEPENDENT_ROPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_model_layer(assert_close, dtype, rope_type: str) -> None:
    generator = torch.Generator().manual_seed(2)
    rotary = layers.RotaryEmbedding(64, 512, {**ROPE, **LENGTH_DEPENDENT_ROPES.get(rope_type, {})})
    qkv = torch.randn(7, (8 + 2 + 2) * 64, generator=generator).to(dtype)
    query = qkv[:, : 8 * 64].view(7, 8, 64)
    key = qkv[:, 8 * 64 : 10 * 64].view(7, 2, 64)
    positions = torch.randint(0, 512, (7,), generator=generator)
    # Some tokens belong to sequences past the original length, some do not.
    lengths = positions + 1 + torch.randint(0, 100, (7,), generator=generator)
    # The layer rounds cos/sin to the activation dtype; the kernel keeps them float32.
    cos_sin = rotary.prepare(positions, torch.float32, sequence_lengths=lengths).cos_sin
    assert cos_sin is not None
    expected_query, expected_key = query.float().clone(), key.float().clone()
    layers.RotaryEmbedding.rotate_(expected_query, *cos_sin)
    layers.RotaryEmbedding.rotate_(expected_key, *cos_sin)

    step = rotary.prepare(positions, dtype, sequence_lengths=lengths)
    fused(rotary, dtype)(step, query, key)

    assert_close(query, expected_query)
    assert_close(key, expected_key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_model_layer(assert_close, dtype) -> None:
    gate_up = torch.randn(4, 2 * 176, generator=torch.Generator().manual_seed(3)).to(dtype)
    activation = layers.SiluAndMul()
    assert_close(fused(activation, dtype)(gate_up), activation.forward_native(gate_up.clone()))


PROBE = """
import json, sys, torch
from kvfleet.runtime.kernels.fused_layers import Implementation
from kvfleet.runtime.models.layers import RMSNorm
x = torch.ones(2, 8)
norm = RMSNorm(8, 1e-6)
norm(x)
torch.set_default_dtype(torch.bfloat16)
half_norm = RMSNorm(8, 1e-6)
half_norm(x.bfloat16())
print(json.dumps({
    "float32": norm.implementation is Implementation.CPU,
    "bfloat16": half_norm.implementation is not Implementation.NATIVE,
    "triton_loaded": "triton" in sys.modules,
}))
"""


def test_cpu_tensors_use_the_cpu_operations_for_float32_and_never_load_triton() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(result.stdout) == {"float32": True, "bfloat16": False, "triton_loaded": False}


def test_the_environment_switch_turns_the_kernels_off(monkeypatch) -> None:
    fused_layers._kernels_available.cache_clear()
    fused_layers._cpu_ops_available.cache_clear()
    monkeypatch.setenv(fused_layers.ENV_VAR, "0")
    try:
        assert fused_layers._kernels_available() is False
        assert fused_for(torch.ones(2)) is False
    finally:
        fused_layers._kernels_available.cache_clear()
        fused_layers._cpu_ops_available.cache_clear()
