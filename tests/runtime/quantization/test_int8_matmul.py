"""The fused int8 matmul against a float64 matmul over the dequantized weight; a checkpoint's quantized
tensors turned into what the model holds: compressed-tensors' int32 words unpacked as the library unpacks
them, float8 weights dequantized, and the tensors that do not fit refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from kvfleet.runtime.quantization.config import WeightQuantization
from kvfleet.runtime.quantization.linear import (
    FUSED_MAX_ROWS,
    QuantizedCheckpoint,
    _unpack,
    feature_block,
    int8_ops_available,
    pack_feature_blocks,
    unpack_feature_blocks,
)
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def int8_linear():
    if not int8_ops_available():
        pytest.skip("the C++ operations cannot be built on this host")
    return torch.ops.kvfleet_cpu_quant.int8_linear


# Row counts through each of the kernel's tiles: one row, two, three, eight (a whole tile), nine (a tile and a
# row) and the most the build's width takes (None). 104 input columns in 1 or 4 groups; the output features
# are nine of the build's blocks (eight or sixteen features each): every tile of two, four or eight blocks
# runs, and one block is left past them.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, None])
@pytest.mark.parametrize("groups", [1, 4])
def test_int8_linear_matches_a_float64_matmul(int8_linear, rows: int | None, groups: int) -> None:
    width = feature_block()
    rows = FUSED_MAX_ROWS[width] if rows is None else rows
    generator = torch.Generator().manual_seed(rows * 10 + groups)
    out_features, in_features = 9 * width, 104
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scale = torch.rand(out_features, groups, generator=generator) / 64 + 1e-3
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    dequantized = weight.double() * scale.double().repeat_interleave(in_features // groups, dim=1)
    expected = x.double() @ dequantized.T
    packed_weight, packed_scale = pack_feature_blocks(weight, width), pack_feature_blocks(scale, width)
    for with_bias in (False, True):
        got = int8_linear(x, packed_weight, packed_scale, bias if with_bias else None)
        want = expected + bias.double() if with_bias else expected
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [8, 16])
def test_packed_feature_blocks_unpack_to_the_weight(width: int) -> None:
    weight = torch.arange(32 * 3, dtype=torch.int8).view(32, 3)
    packed = pack_feature_blocks(weight, width)
    assert packed.shape == (32 // width, 3, width)
    assert packed[1, 2].tolist() == weight[width : 2 * width, 2].tolist()
    assert torch.equal(unpack_feature_blocks(packed), weight)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("columns", [64, 37])
def test_unpack_matches_compressed_tensors(num_bits: int, columns: int) -> None:
    generator = torch.Generator().manual_seed(num_bits + columns)
    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    values = torch.randint(low, high, (6, columns), dtype=torch.int8, generator=generator)
    packed = pack_to_int32(values, num_bits)
    shape = torch.tensor(values.shape)
    expected = unpack_from_int32(packed, num_bits, values.shape)
    assert torch.equal(_unpack(packed, shape, num_bits, "proj", columns), expected)
    with pytest.raises(ValueError, match=r"'proj\.weight_packed' has shape"):
        _unpack(packed[:, :-1], shape, num_bits, "proj", columns)
    if columns % (2 * 32 // num_bits) == 0:
        # A tensor-parallel rank's share: the second half of the words and the rows after the first two.
        words = packed.shape[1] // 2
        share = _unpack(packed[2:, words:], shape, num_bits, "proj", columns // 2)
        assert torch.equal(share, expected[2:, columns // 2 :])


def _checkpoint(tmp_path: Path, scheme: WeightQuantization, tensors: dict[str, torch.Tensor]):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = QuantizedCheckpoint(scheme, [tmp_path / "model.safetensors"])
    return dict(checkpoint.tensors(tensors.items()))


def test_float8_weights_are_dequantized_with_per_tensor_scales(tmp_path: Path) -> None:
    scheme = WeightQuantization(
        type="float", num_bits=8, strategy="tensor", group_size=None, format="float-quantized"
    )
    weight = (torch.randn(8, 4) * 3).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.25])
    loaded = _checkpoint(
        tmp_path, scheme, {"p.weight": weight, "p.weight_scale": scale, "norm.weight": scale.clone()}
    )
    assert set(loaded) == {"p.weight", "norm.weight"}
    torch.testing.assert_close(loaded["p.weight"], weight.float() * 0.25, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"'p\.weight_scale' has shape \(8, 1\), expected \(1,\)"):
        _checkpoint(tmp_path, scheme, {"p.weight": weight, "p.weight_scale": torch.ones(8, 1)})


def test_int8_weights_pass_beside_their_scales_and_a_missing_part_is_named(tmp_path: Path) -> None:
    scheme = WeightQuantization(
        type="int", num_bits=8, strategy="channel", group_size=None, format="int-quantized"
    )
    weight = torch.randint(-128, 128, (8, 4), dtype=torch.int8)
    loaded = _checkpoint(tmp_path, scheme, {"p.weight": weight, "p.weight_scale": torch.ones(8, 1)})
    assert torch.equal(loaded["p.weight"], weight) and loaded["p.weight_scale"].shape == (8, 1)
    packed = WeightQuantization(
        type="int", num_bits=8, strategy="channel", group_size=None, format="pack-quantized"
    )
    words = pack_to_int32(weight, 8)
    with pytest.raises(ValueError, match=r"checkpoint has no p\.weight_shape for the quantized p"):
        _checkpoint(tmp_path, packed, {"p.weight_packed": words, "p.weight_scale": torch.ones(8, 1)})


# Groups of rows through a tile and its remainder, one of none, and more than a tile; five feature blocks a
# projection, so that the kernel's tasks of four blocks run across one expert's end into the next's.
@pytest.mark.parametrize("sizes", [[1], [2, 9], [3, 0, 17]])
def test_int8_grouped_linear_is_each_experts_matmul(int8_linear, sizes: list[int]) -> None:
    width = feature_block()
    generator = torch.Generator().manual_seed(len(sizes))
    out_features, in_features, groups = 5 * width, 104, 4
    weights = [
        torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        for _ in sizes
    ]
    scales = [torch.rand(out_features, groups, generator=generator) / 64 + 1e-3 for _ in sizes]
    x = torch.randn(sum(sizes), in_features, generator=generator)
    expected = torch.cat(
        [
            rows.double() @ (weight.double() * scale.double().repeat_interleave(in_features // groups, 1)).T
            for rows, weight, scale in zip(x.split(sizes), weights, scales, strict=True)
        ]
    )
    got = torch.ops.kvfleet_cpu_quant.int8_grouped_linear(
        x,
        [pack_feature_blocks(weight, width) for weight in weights],
        [pack_feature_blocks(scale, width) for scale in scales],
        sizes,
    )
    assert got.dtype == torch.float32 and got.shape == (sum(sizes), out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_int8_grouped_linear_refuses_experts_of_other_shapes(int8_linear) -> None:
    width = feature_block()
    weight = pack_feature_blocks(torch.zeros(2 * width, 32, dtype=torch.int8), width)
    scale = pack_feature_blocks(torch.ones(2 * width, 1), width)
    narrow = pack_feature_blocks(torch.zeros(width, 32, dtype=torch.int8), width)
    grouped = torch.ops.kvfleet_cpu_quant.int8_grouped_linear
    with pytest.raises(RuntimeError, match="every expert's weight is packed"):
        grouped(torch.zeros(2, 32), [weight, narrow], [scale, scale], [1, 1])
    with pytest.raises(RuntimeError, match="the sizes must add up to x's rows"):
        grouped(torch.zeros(3, 32), [weight, weight], [scale, scale], [1, 1])
