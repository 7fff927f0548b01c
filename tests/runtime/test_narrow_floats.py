"""The API server's bfloat16 and fp8 rounding against ml_dtypes' casts: float32 values of every kind (random
bits, so NaNs, infinities, subnormals and the largest values; values spread over fp8's range; and the ties
and overflow edges of each type), each to the same bits."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from kvfleet.runtime.serving.narrow_floats import E4M3FN, E5M2, bfloat16_bits, float8_bits

EDGES = [0.0, -0.0, 1.0, 448.0, 464.0, 464.01, 480.0, 57344.0, 59392.0, 61439.0, 61440.0, 2.0**-10, 2.0**-17]


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # Quiet NaNs only: a signalling one is not a value an embedding holds.
    random_bits = np.where(np.isnan(random_bits), np.float32(np.nan), random_bits)
    spread = rng.standard_normal(200_000) * np.exp2(rng.uniform(-20, 18, 200_000))
    edges = np.array([*EDGES, np.inf, np.nan])
    return np.concatenate([random_bits, spread, edges, -edges]).astype(np.float32)


@pytest.mark.parametrize(
    ("rounding", "dtype"),
    [
        (bfloat16_bits, ml_dtypes.bfloat16),
        (lambda values: float8_bits(values, E4M3FN), ml_dtypes.float8_e4m3fn),
        (lambda values: float8_bits(values, E5M2), ml_dtypes.float8_e5m2),
    ],
    ids=["bfloat16", "fp8_e4m3", "fp8_e5m2"],
)
def test_each_value_rounds_to_ml_dtypes_bits(
    rounding: Callable[[np.ndarray], np.ndarray], dtype: type
) -> None:
    values = _values()
    expected = values.astype(dtype)
    bits = rounding(values)
    assert bits.dtype.itemsize == expected.itemsize
    mismatched = np.flatnonzero(bits != expected.view(bits.dtype))
    assert not len(mismatched), list(zip(values[mismatched[:5]], bits[mismatched[:5]], strict=True))
