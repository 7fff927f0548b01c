"""The Triton int8 matmul (interpreted) against a float64 matmul over the dequantized weight: per-channel and
group scales, row counts of a decode step and of more (each with its own tiling) and widths that leave
partial tiles, each activation dtype."""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.kernels.int8_matmul import block_k, int8_matmul

# Each dtype's tolerance: bfloat16 and float16 products are rounded to the activations' precision.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(("in_features", "groups"), [(96, 1), (96, 3)])
@pytest.mark.parametrize("rows", [5, 40])
def test_int8_matmul_matches_a_float64_matmul(
    dtype: torch.dtype, in_features: int, groups: int, rows: int
) -> None:
    generator = torch.Generator().manual_seed(groups)
    out_features = 80
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scale = torch.rand(out_features, groups, generator=generator) / 256 + 1e-3
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    dequantized = weight.double() * scale.double().repeat_interleave(in_features // groups, dim=1)
    expected = x.double() @ dequantized.T + bias.double()
    got = int8_matmul(x, weight, scale.to(dtype), bias)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


def test_group_sizes_the_tiles_cannot_take_are_declined() -> None:
    assert block_k(96, 3) == 32 and block_k(100, 1) == 128
    assert block_k(100, 4) is None  # groups of 25 columns
