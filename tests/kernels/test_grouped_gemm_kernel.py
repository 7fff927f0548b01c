"""The grouped GEMM of mixture-of-experts layers (interpreted) against a float64 matmul per expert:
decode-sized and prefill-sized groups, empty groups, and widths that are not multiples of the blocks."""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.kernels.grouped_gemm import grouped_gemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("sizes", "in_features", "out_features"), [([3, 0, 5, 1], 64, 48), ([70, 2, 0, 17], 40, 100)]
)
def test_grouped_gemm_is_a_matmul_per_expert(
    assert_close, dtype: torch.dtype, sizes: list[int], in_features: int, out_features: int
) -> None:
    generator = torch.Generator().manual_seed(sum(sizes))
    # Rows of a wider buffer: the kernel must follow x's row stride.
    x = torch.randn(sum(sizes), in_features + 8, generator=generator)[:, :in_features].to(dtype)
    weight = (torch.randn(len(sizes), out_features, in_features, generator=generator) / in_features**0.5).to(
        dtype
    )
    groups = zip(x.split(sizes), weight, strict=True)
    expected = torch.cat([rows.double() @ expert.double().T for rows, expert in groups])
    assert_close(grouped_gemm(x, weight, sizes), expected.to(dtype))


def test_grouped_gemm_refuses_sizes_that_do_not_cover_the_rows() -> None:
    with pytest.raises(ValueError, match="add up to x's rows"):
        grouped_gemm(torch.zeros(4, 8), torch.zeros(2, 8, 8), [1, 2])
