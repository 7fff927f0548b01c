"""Fused RMSNorm + residual, in-place rotary embedding and SiLU-and-mul against their torch versions."""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.kernels import torch_reference
from kvfleet.runtime.kernels.activation import silu_and_mul
from kvfleet.runtime.kernels.rms_norm import rms_norm
from kvfleet.runtime.kernels.rotary import rotary_embedding_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(assert_close, dtype, hidden_size, with_residual) -> None:
    generator = torch.Generator().manual_seed(hidden_size)
    # Rows of a wider buffer: the kernel must follow the row stride.
    x = randn(generator, 9, hidden_size + 16, dtype=dtype)[:, :hidden_size]
    residual = randn(generator, 9, hidden_size, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * randn(generator, hidden_size, dtype=torch.float32)).to(dtype)

    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_residual = torch_reference.rms_norm(x, weight, 1e-6, residual)

    assert_close(out, expected_out)
    if dtype == torch.bfloat16:
        # The interpreter truncates float32 to bfloat16 where compiled kernels round to nearest: one ulp.
        torch.testing.assert_close(new_residual, expected_residual, rtol=2**-7, atol=0)
    else:
        assert torch.equal(new_residual, expected_residual)
    if not with_residual:
        assert new_residual is x


def test_rms_norm_refuses_a_weight_of_another_dtype() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 64), torch.ones(64, dtype=torch.float16), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 128), (6, 1, 32)])
def test_rotary_embedding_in_place_on_fused_qkv_views(
    assert_close, dtype, num_heads, num_kv_heads, head_dim
) -> None:
    generator = torch.Generator().manual_seed(num_heads * head_dim)
    num_tokens, max_position = 11, 300
    qkv = randn(generator, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    query, key, value = qkv.split(sizes, dim=1)
    query = query.view(num_tokens, num_heads, head_dim)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value_before = value.clone()
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator)
    cache = torch_reference.rotary_cos_sin_cache(head_dim, max_position)
    expected_query, expected_key = query.clone(), key.clone()

    rotary_embedding_(positions, query, key, cache)
    torch_reference.rotary_embedding_(positions, expected_query, expected_key, cache)

    assert_close(query, expected_query)
    assert_close(key, expected_key)
    assert torch.equal(value, value_before)


def test_rotary_refuses_a_cache_of_the_wrong_width() -> None:
    query, key = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding_(torch.arange(3), query, key, torch.randn(10, 32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate_size", [100, 1500])
def test_silu_and_mul(assert_close, dtype, intermediate_size) -> None:
    generator = torch.Generator().manual_seed(intermediate_size)
    x = 3 * randn(generator, 5, 2 * intermediate_size, dtype=dtype)
    assert_close(silu_and_mul(x), torch_reference.silu_and_mul(x))


def test_silu_and_mul_refuses_an_odd_width() -> None:
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul(torch.randn(2, 7))
