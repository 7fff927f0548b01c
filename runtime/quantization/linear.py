"""Quantized projections, and a compressed-tensors checkpoint read into them.

Int8 and int4 weights are held as int8 [out, in] with float32 scales [out, groups] (one group of the whole
row for per-channel scales); int4 values take a byte each, so both move a quarter of float32's bytes. Where
the CPU kernel runs them, both are packed once loaded, in blocks of its feature width. Float8 weights are
dequantized as they are read: the model then holds an ordinary float projection.

A layer binds its matmul when built: for float32 on the CPU the fused int8 matmul of `cpu_quant.cpp` (a
mixture-of-experts layer's routed experts in one call of it), for decode steps and short prefills, and on CUDA
Triton's (`kernels.int8_matmul`), each for up to a few hundred rows (on the CPU with AVX-512, up to 2,048);
longer inputs (prefill) dequantize the weight and run a float matmul, since there the computation, not the
weight's bytes, is the cost; elsewhere the torch code, a float matmul over the dequantized weight.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from kvfleet.runtime.kernels.cpu_build import CPU_QUANT, build_cpu_ops
from kvfleet.runtime.kernels.fused_layers import Implementation, implementation_for
from kvfleet.runtime.quantization.config import WeightQuantization
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

# Rows up to which the fused int8 matmul runs, by the width of the CPU build's feature blocks; past them a
# float matmul over the dequantized weight is faster, where the arithmetic, not the weight's bytes, is the
# cost. The `small` model's 32 projections on 2 threads: on an AVX2 CPU (blocks of eight) the packed kernel
# took 81 to 105 ms at 256 rows against 138 to 242 for dequantizing, and the two crossed between 400 and 500
# rows; on an AVX-512 Xeon (blocks of sixteen) it stayed 2% to 16% ahead from 384 rows up to 2,048, the most
# measured. On an H200 (Llama-3-8B's gate and up projection) Triton's kernel was 10x faster than
# dequantizing at 64 rows and 2x slower at 8,192 rows.
FUSED_MAX_ROWS = {8: 256, 16: 2048}
CUDA_FUSED_MAX_ROWS = 512


@functools.cache
def int8_ops_available() -> bool:
    return build_cpu_ops(CPU_QUANT)


@functools.cache
def feature_block() -> int:
    """How many output features the fused CPU kernel packs in a block: one float32 vector of its build."""
    return torch.ops.kvfleet_cpu_quant.feature_block()


def pack_feature_blocks(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[out, n] -> [out / width, n, width]: each block of output features, column by column."""
    out, columns = tensor.shape
    return tensor.view(out // width, width, columns).transpose(1, 2).contiguous()


def unpack_feature_blocks(packed: torch.Tensor) -> torch.Tensor:
    """[out / width, n, width] -> [out, n], as it was before `pack_feature_blocks`."""
    blocks, columns, width = packed.shape
    return packed.transpose(1, 2).reshape(blocks * width, columns)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [out, in] times scale [out, groups], each scale over in / groups consecutive columns."""
    groups = scale.shape[1]
    if groups == 1:
        return weight.to(dtype) * scale.to(dtype)
    grouped = weight.to(dtype).view(weight.shape[0], groups, -1) * scale.to(dtype).unsqueeze(-1)
    return grouped.view(weight.shape)


class Int8Linear(nn.Module):
    """A projection with int8 weights and float scales per output channel or per group of input columns."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, groups: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        # NaN until loaded, so that a checkpoint that lacks some rows' scales is caught (`check_loaded`).
        self.weight_scale = nn.Parameter(
            torch.full((out_features, groups), float("nan")), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.kernel = _kernel_for(self.weight.device, dtype, in_features, out_features, groups)

    def check_loaded(self, name: str) -> None:
        if bool(self.weight_scale.isnan().any()):
            raise ValueError(f"checkpoint left some of {name}'s weight_scale rows unloaded")

    def pack_for_cpu(self) -> None:
        """Pack the loaded weight and scales in the CPU kernel's feature blocks; afterwards the layer is
        inference-only."""
        width = feature_block()
        self.weight = nn.Parameter(pack_feature_blocks(self.weight.detach(), width), requires_grad=False)
        self.weight_scale = nn.Parameter(
            pack_feature_blocks(self.weight_scale.detach(), width), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, scale = self.weight, self.weight_scale
        # Packed (`pack_for_cpu`) the weight is [out / width, in, width].
        packed = weight.dim() == 3
        if packed and x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS[weight.shape[2]]:
            return torch.ops.kvfleet_cpu_quant.int8_linear(x, weight, scale, self.bias)
        if self.kernel is Implementation.CUDA and x.dim() == 2 and x.shape[0] <= CUDA_FUSED_MAX_ROWS:
            from kvfleet.runtime.kernels.int8_matmul import int8_matmul

            return int8_matmul(x, weight, scale, self.bias)
        if packed:
            weight, scale = unpack_feature_blocks(weight), unpack_feature_blocks(scale)
        return F.linear(x, dequantize(weight, scale, x.dtype), self.bias)


def grouped_int8_linear(x: torch.Tensor, projections: list[Int8Linear], sizes: list[int]) -> torch.Tensor:
    """x's rows in consecutive groups, sizes[i] rows for projections[i] (a mixture-of-experts layer's, all of
    one shape and without bias) -> [rows, out]: one call of the fused CPU kernel for them all where they are
    packed for it and no group has more rows than it takes, else each projection on its rows."""
    weight = projections[0].weight
    if weight.dim() == 3 and x.dim() == 2 and max(sizes) <= FUSED_MAX_ROWS[weight.shape[2]]:
        return torch.ops.kvfleet_cpu_quant.int8_grouped_linear(
            x, [p.weight for p in projections], [p.weight_scale for p in projections], sizes
        )
    return torch.cat([p(rows) for p, rows in zip(projections, x.split(sizes), strict=True)])


def _kernel_for(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int, groups: int
) -> Implementation:
    """The fused C++ matmul for float32 on the CPU, Triton's on CUDA where the group size suits its tiles,
    else the torch code (a float matmul over the dequantized weight)."""
    if device.type == "cpu":
        fits = dtype == torch.float32 and int8_ops_available() and out_features % feature_block() == 0
        return Implementation.CPU if fits else Implementation.NATIVE
    if implementation_for(device, dtype) is Implementation.CUDA:
        from kvfleet.runtime.kernels.int8_matmul import block_k

        if block_k(in_features, groups) is not None:
            return Implementation.CUDA
    return Implementation.NATIVE


class QuantizedCheckpoint:
    """How one folder's compressed-tensors checkpoint is loaded: which projections become `Int8Linear` (a
    mixture-of-experts model's experts among them), and its tensors turned into what those hold."""

    def __init__(self, scheme: WeightQuantization, files: list[Path]) -> None:
        self.scheme = scheme
        # The checkpoint's quantized projections (their names less `.weight_scale`) and their scales' shapes.
        self._scale_shapes: dict[str, list[int]] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                    if name.endswith(".weight_scale"):
                        self._scale_shapes[name.removesuffix(".weight_scale")] = f.get_slice(name).get_shape()
        # Each quantized projection's input columns on this rank (a share of them under tensor parallelism).
        self._columns: dict[str, int] = {}

    def replace_linears(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Put an `Int8Linear` in place of each projection the checkpoint holds as int."""
        if self.scheme.type != "int":
            return
        parameter_of = getattr(model, "parameter_of", None)
        if parameter_of is None:
            raise ValueError(f"{type(model).__name__} does not load quantized checkpoints")
        modules = dict(model.named_modules())
        # A pipeline stage holds its own layers' projections only (checkpoint_slice says which).
        holds = getattr(model, "checkpoint_slice", None)
        held = [
            name
            for name in self._scale_shapes
            if holds is None or holds(f"{name}.weight_scale", self._scale_shapes[name]) is not None
        ]
        # A mixture-of-experts model holds its quantized experts itself (`MoeForCausalLM.quantize_experts`).
        quantize_experts = getattr(model, "quantize_experts", None)
        experts = {} if quantize_experts is None else quantize_experts(held, self._groups, dtype)
        held = [name for name in held if name not in experts]
        targets = {name: parameter_of(f"{name}.weight").removesuffix(".weight") for name in held}
        for target in sorted(set(targets.values())):
            linear = modules.get(target)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"checkpoint quantizes {target}, which is not a projection of the model")
            groups = self._groups(linear.in_features, target)
            replacement = Int8Linear(
                linear.in_features, linear.out_features, linear.bias is not None, groups, dtype
            )
            parent_name, _, child = target.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        self._columns = {**experts, **{name: modules[target].in_features for name, target in targets.items()}}

    @staticmethod
    def pack_for_cpu(model: nn.Module) -> None:
        """Pack every loaded `Int8Linear` that the CPU kernel runs."""
        for module in model.modules():
            if isinstance(module, Int8Linear) and module.kernel is Implementation.CPU:
                module.pack_for_cpu()

    @staticmethod
    def check_loaded(model: nn.Module) -> None:
        """Raises ValueError naming a quantized projection whose scales the checkpoint did not fill."""
        for name, module in model.named_modules():
            if isinstance(module, Int8Linear):
                module.check_loaded(name)

    def _groups(self, in_features: int, name: str) -> int:
        group_size = self.scheme.group_size
        if group_size is None:
            return 1
        if in_features % group_size:
            raise ValueError(
                f"{name}: group_size {group_size} does not divide the {in_features} input features it has "
                "on this rank"
            )
        return in_features // group_size

    def tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the model holds them: int weights unpacked to int8 [out, in] beside
        their scales, float8 weights dequantized. Raises ValueError naming a tensor of the wrong shape or
        dtype, or one whose partner tensors are missing."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        parts = ("weight_packed", "weight_shape") if self.scheme.packed else ("weight",)
        if self.scheme.type == "float":
            parts = (*parts, "weight_scale")
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".")
            if prefix not in self._scale_shapes or part not in parts:
                yield name, tensor
                continue
            held = pending.setdefault(prefix, {})
            held[part] = tensor
            if len(held) == len(parts):
                del pending[prefix]
                yield f"{prefix}.weight", self._weight(prefix, held)
        if pending:
            prefix, held = next(iter(pending.items()))
            missing = sorted(set(parts) - set(held))
            raise ValueError(f"checkpoint has no {prefix}.{missing[0]} for the quantized {prefix}")

    def _weight(self, prefix: str, held: dict[str, torch.Tensor]) -> torch.Tensor:
        scheme = self.scheme
        if scheme.type == "float":
            weight, scale = held["weight"], held["weight_scale"]
            _check_dtype(weight, torch.float8_e4m3fn, f"{prefix}.weight")
            expected = (1,) if scheme.strategy == "tensor" else (weight.shape[0], 1)
            if scale.numel() != expected[0] or (scheme.strategy == "channel" and scale.dim() != 2):
                raise ValueError(
                    f"checkpoint tensor '{prefix}.weight_scale' has shape {tuple(scale.shape)}, expected "
                    f"{expected} ({scheme.strategy} scales)"
                )
            return weight.float() * scale.float().reshape(-1, 1)
        if not scheme.packed:
            _check_dtype(held["weight"], torch.int8, f"{prefix}.weight")
            return held["weight"]
        return _unpack(
            held["weight_packed"], held["weight_shape"], scheme.num_bits, prefix, self._columns[prefix]
        )


def _check_dtype(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, expected {dtype}")


def _unpack(
    packed: torch.Tensor, shape: torch.Tensor, num_bits: int, prefix: str, columns: int
) -> torch.Tensor:
    """compressed-tensors' pack-quantized int32 words back to int8 [rows, columns]: each word holds
    32 / num_bits values from its lowest bits up, each stored plus 2^(num_bits - 1). `columns`: the
    projection's input columns on this rank, of the whole weight's (`shape`) or a tensor-parallel share of
    them; the rows are those of the words read (the rank's, likewise)."""
    _check_dtype(packed, torch.int32, f"{prefix}.weight_packed")
    if shape.numel() != 2:
        raise ValueError(
            f"checkpoint tensor '{prefix}.weight_shape' must hold two sizes, got {shape.tolist()}"
        )
    whole_rows, whole_columns = (int(n) for n in shape.tolist())
    per_word = 32 // num_bits
    fits = (
        packed.dim() == 2
        and 0 < packed.shape[0] <= whole_rows
        and whole_columns % columns == 0
        # A share of the columns starts at a word: its first value is the word's first.
        and (columns == whole_columns or columns % per_word == 0)
        and packed.shape[1] == -(-columns // per_word)
    )
    if not fits:
        raise ValueError(
            f"checkpoint tensor '{prefix}.weight_packed' has shape {tuple(packed.shape)}, which does not "
            f"hold {columns} of the columns of a {whole_rows}x{whole_columns} weight of int{num_bits}"
        )
    rows = packed.shape[0]
    # Little-endian words: their bytes in order hold the values in order (hosts are little-endian).
    data = packed.contiguous().view(torch.uint8).view(rows, -1)
    if num_bits == 4:
        data = torch.stack((data & 0xF, data >> 4), dim=-1).view(rows, -1)
    offset = 1 << (num_bits - 1)
    return (data[:, :columns].to(torch.int16) - offset).to(torch.int8).contiguous()
