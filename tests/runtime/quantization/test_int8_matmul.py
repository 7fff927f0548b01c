"""The fused int8 matmul against a float64 matmul over the dequantized weight, and the unpacking of
compressed-tensors' int32 words against the library's own."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from kvfleet.runtime.quantization.linear import FUSED_MAX_ROWS, _unpack, int8_ops_available


@pytest.fixture(scope="module")
def int8_linear():
    if not int8_ops_available():
        pytest.skip("the C++ operations cannot be built on this host")
    return torch.ops.kvfleet_cpu_quant.int8_linear


# Row counts through each of the kernel's paths: one or two rows read the int8 weight directly, more rows a
# dequantized block of it, in pairs and with an odd row left over.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, FUSED_MAX_ROWS])
@pytest.mark.parametrize("groups", [1, 4])
def test_int8_linear_matches_a_float64_matmul(int8_linear, rows: int, groups: int) -> None:
    generator = torch.Generator().manual_seed(rows * 10 + groups)
    out_features, in_features = 36, 96
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scale = torch.rand(out_features, groups, generator=generator) / 64 + 1e-3
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    dequantized = weight.double() * scale.double().repeat_interleave(in_features // groups, dim=1)
    expected = x.double() @ dequantized.T
    for with_bias in (False, True):
        got = int8_linear(x, weight, scale, bias if with_bias else None)
        want = expected + bias.double() if with_bias else expected
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("columns", [64, 37])
def test_unpack_matches_compressed_tensors(num_bits: int, columns: int) -> None:
    generator = torch.Generator().manual_seed(num_bits + columns)
    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    values = torch.randint(low, high, (6, columns), dtype=torch.int8, generator=generator)
    packed = pack_to_int32(values, num_bits)
    shape = torch.tensor(values.shape)
    expected = unpack_from_int32(packed, num_bits, values.shape)
    assert torch.equal(_unpack(packed, shape, num_bits, "proj"), expected)
    with pytest.raises(ValueError, match=r"'proj\.weight_packed' has shape"):
        _unpack(packed[:, :-1], shape, num_bits, "proj")
