"""float32 values rounded to bfloat16 or fp8 (OCP's E4M3FN and E5M2), as the integers of their bits.

numpy has none of these types. torch and ml_dtypes have them, but loading either holds the API server's event
loop for most of a second or more (torch also takes some hundreds of MB): this is the rounding they do, in
numpy. Each value goes to the nearest one of the type, ties to the one whose last bit is 0; a value that
rounds past the largest finite one becomes the type's infinity (NaN for E4M3FN, which has none), and NaN the
type's quiet NaN, each with the value's sign.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

_BFLOAT16_QUIET_NAN = 0x7FC0


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 is float32's upper half: the lower half rounds it, to nearest and ties to even."""
    bits = values.astype(np.float32).view(np.uint32)
    upper = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = np.uint16(_BFLOAT16_QUIET_NAN) | (upper & np.uint16(0x8000))
    return np.where(np.isnan(values), quiet_nan, upper)


@dataclass(frozen=True)
class Float8Format:
    exponent_bits: int
    mantissa_bits: int
    largest_finite_code: int
    overflow_code: int
    nan_code: int

    @property
    def bias(self) -> int:
        return (1 << (self.exponent_bits - 1)) - 1


E4M3FN = Float8Format(
    exponent_bits=4, mantissa_bits=3, largest_finite_code=0x7E, overflow_code=0x7F, nan_code=0x7F
)
E5M2 = Float8Format(
    exponent_bits=5, mantissa_bits=2, largest_finite_code=0x7B, overflow_code=0x7C, nan_code=0x7E
)


@cache
def _magnitudes(form: Float8Format) -> np.ndarray:
    """The magnitude of each code from 0 up to one past the largest finite, read with the exponent unbounded:
    codes are in the order of their magnitudes, and the one past the largest is where rounding overflows."""
    codes = np.arange(form.largest_finite_code + 2)
    exponents = codes >> form.mantissa_bits
    fractions = (codes & ((1 << form.mantissa_bits) - 1)) / (1 << form.mantissa_bits)
    normal = (1 + fractions) * np.exp2(exponents - form.bias)
    subnormal = fractions * np.exp2(1 - form.bias)
    return np.where(exponents > 0, normal, subnormal)


def float8_bits(values: np.ndarray, form: Float8Format) -> np.ndarray:
    magnitudes = _magnitudes(form)
    size = np.abs(values.astype(np.float64))
    # A size beyond every magnitude (an infinity) takes the last as the nearer one: it overflows.
    above = np.clip(np.searchsorted(magnitudes, size), 1, len(magnitudes) - 1)
    below = above - 1
    over, under = magnitudes[above] - size, size - magnitudes[below]
    # Codes ascend with magnitudes, so the even code is the one whose last mantissa bit is 0.
    nearest = np.where((over < under) | ((over == under) & (above % 2 == 0)), above, below)
    codes = np.where(nearest > form.largest_finite_code, form.overflow_code, nearest)
    codes = np.where(np.isnan(values), form.nan_code, codes)
    return (codes | np.where(np.signbit(values), 0x80, 0)).astype(np.uint8)
