"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): the Llama-family model with the MLP of its sparse layers
replaced by a router and its experts.

The router scores every expert (a softmax over its logits, in float32) and each token goes to its top-k,
weighted by their probabilities (renormalised over the k where the model says so). The experts run grouped,
not token by token: the token-expert pairs are sorted by expert, and each expert multiplies its rows in one
matmul (`GroupedLinear`: torch's grouped matmul on the CPU, a Triton grouped GEMM on CUDA); then each pair's
output, weighted, is put back in its place among its token's k, and each token's k are summed.

Tensor parallelism splits each expert like a dense MLP: a rank holds its columns of every expert's gate/up
projection and the matching rows of its down projection. With expert parallelism (`enable_expert_parallel`)
a rank holds whole experts instead, a 1/tp share of them, and computes only the pairs routed to them. Either
way each rank's output is a partial sum, all-reduced; the router is whole on every rank, so all of them route
alike.

Checkpoints name the experts one by one (`experts.N.w1/w2/w3` in Mixtral's, under `block_sparse_moe`;
`experts.N.gate_proj/up_proj/down_proj` in Qwen3-MoE's) or stacked, as Transformers 5 holds them in memory
(`experts.gate_up_proj` [experts, 2 x intermediate, hidden] and `experts.down_proj` [experts, hidden,
intermediate]). A stacked gate/up tensor is read whole by a tensor-parallel rank without expert parallelism
(its slice of gate rows and its slice of up rows are not one range), and cut here.

A compressed-tensors checkpoint quantizes the experts one by one, as Linear modules. Float8 experts reach the
model dequantized (`QuantizedCheckpoint.tensors`), into the float stacks; int8 and int4 ones stay int8, in an
`Int8Experts` that the checkpoint puts in place of the float stacks (`quantize_experts`): a quantized
projection per expert, those with rows run together (`grouped_int8_linear`), so that a decode step reads only
its routed experts' weights, a quarter of their float32 bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate

import torch
import torch.nn.functional as F
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.distributed.parallel import ParallelContext, shard_range
from kvfleet.runtime.kernels.fused_layers import CustomOp
from kvfleet.runtime.models.layers import Linear, SiluAndMul, copy_checkpoint_tensor
from kvfleet.runtime.models.llama import LlamaForCausalLM, input_columns
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.moe_config import MoeConfig, MoeLayerLoad
from kvfleet.runtime.quantization.linear import Int8Linear, grouped_int8_linear
from torch import nn

# model.layers.L.{mlp|block_sparse_moe}.experts. then N.<projection>.<tensor> (one expert: its weight, or a
# quantized one's scales, packed words or shape) or <stacked name>.
_EXPERT_TENSOR = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?:(?P<expert>\d+)\.(?P<projection>w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.(?P<tensor>weight|weight_scale|weight_packed|weight_shape)"
    r"|(?P<stacked>gate_up_proj|down_proj))"
)
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_PARTS = ("gate", "up", "down")
# What each stacked checkpoint tensor fills of every expert.
_PARTS_OF = {"gate_up": ("gate", "up"), "down": ("down",)}
# Rows per expert above which CUDA runs a cuBLAS matmul per expert instead of the grouped kernel.
GROUPED_GEMM_MAX_ROWS = 128


class RoutedExperts(nn.Module):
    """A layer's experts on this rank, and the token-expert pairs routed to them: which experts and which
    share of each the rank holds, and the pairs' outputs put back in their tokens' places. What the experts
    hold and how they compute is the subclasses' (`expert_mlp`, `load`)."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.intermediate_size = moe.moe_intermediate_size
        tp_size, tp_rank = parallel.tp_size, parallel.tp_rank
        if parallel.enable_expert_parallel:
            first, count = shard_range(moe.num_experts, tp_size, tp_rank)
            self.intermediate_start, self.local_intermediate = 0, moe.moe_intermediate_size
        else:
            first, count = 0, moe.num_experts
            self.intermediate_start, self.local_intermediate = shard_range(
                moe.moe_intermediate_size, tp_size, tp_rank
            )
        self.local_experts = range(first, first + count)
        self.act_fn = SiluAndMul()

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, sizes: list[int]
    ) -> torch.Tensor:
        """hidden [tokens, hidden]; weights and experts [tokens, top_k]; sizes: the pairs routed to each of
        the model's experts. Returns this rank's part of the weighted sum over each token's experts."""
        num_tokens, top_k = experts.shape
        first = self.local_experts.start
        local_sizes = sizes[first : self.local_experts.stop]
        start = sum(sizes[:first])
        end = start + sum(local_sizes)
        # Each pair's output in its place among its token's top_k (zeros where another rank's expert has it),
        # then summed per token. Not index_add_: on the CPU its kernel stalled for milliseconds when the
        # cores were busy with other processes, where a copy and a sum did not.
        by_pair = hidden.new_zeros(num_tokens * top_k, hidden.shape[1])
        if start < end:
            pairs = experts.flatten().argsort()[start:end]  # the pairs of this rank's experts, by expert
            rows = pairs // top_k
            expert_out = self.expert_mlp(hidden.index_select(0, rows), local_sizes)
            scaled = expert_out * weights.flatten()[pairs].unsqueeze(1)
            by_pair.index_copy_(0, pairs, scaled.to(hidden.dtype))
        return by_pair.view(num_tokens, top_k, -1).sum(dim=1)

    def expert_mlp(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """x's rows in consecutive groups, sizes[e] rows for the rank's e-th expert, each through its expert's
        MLP -> [rows, hidden]."""
        raise NotImplementedError

    def load(
        self, part: str, expert: int | None, tensor: torch.Tensor, hf_name: str, held: str = "weight"
    ) -> None:
        """Copy one expert's gate, up or down projection (`held`: its weight, or a quantized one's scales), or
        the stacked gate_up or down of all experts (expert None), as `MoeForCausalLM.checkpoint_slice` read
        it."""
        raise NotImplementedError


class FusedMoE(RoutedExperts):
    """Float experts, stacked: w13 [local experts, 2 x local intermediate, hidden] (gate rows, then up rows)
    and w2 [local experts, hidden, local intermediate]."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, parallel: ParallelContext) -> None:
        super().__init__(config, moe, parallel)
        count, hidden, width = len(self.local_experts), config.hidden_size, self.local_intermediate
        # Every element is overwritten by the checkpoint, which load_weights checks.
        self.w13_weight = nn.Parameter(torch.empty(count, 2 * width, hidden))
        self.w2_weight = nn.Parameter(torch.empty(count, hidden, width))
        self.grouped_linear = GroupedLinear()

    def expert_mlp(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        gate_up = self.grouped_linear(x, self.w13_weight, sizes)
        return self.grouped_linear(self.act_fn(gate_up), self.w2_weight, sizes)

    def load(
        self, part: str, expert: int | None, tensor: torch.Tensor, hf_name: str, held: str = "weight"
    ) -> None:
        if held != "weight":
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has no place in float experts: no quantization_config in "
                "config.json makes them int8"
            )
        width = self.local_intermediate
        if expert is not None:
            local = expert - self.local_experts.start
            if part == "down":
                copy_checkpoint_tensor(self.w2_weight.data[local], tensor, hf_name)
            else:
                rows = self.w13_weight.data[local].narrow(0, 0 if part == "gate" else width, width)
                copy_checkpoint_tensor(rows, tensor, hf_name)
            return
        if part == "down":
            copy_checkpoint_tensor(self.w2_weight.data, tensor, hf_name)
            return
        read = (len(self.local_experts), 2 * self.intermediate_size, self.w13_weight.shape[2])
        if tuple(tensor.shape) != read:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {read}"
            )
        # This rank's columns of gate, then of up.
        for source_row, target_row in ((0, 0), (self.intermediate_size, width)):
            target = self.w13_weight.data.narrow(1, target_row, width)
            copy_checkpoint_tensor(
                target, tensor.narrow(1, source_row + self.intermediate_start, width), hf_name
            )


class Int8Experts(RoutedExperts):
    """Int8 experts (a compressed-tensors checkpoint's int8 or int4 ones), each its own quantized gate/up
    (`w13[e]`: gate rows, then up rows) and down (`w2[e]`) projection, which bind their matmul when built."""

    def __init__(
        self,
        config: ModelConfig,
        moe: MoeConfig,
        parallel: ParallelContext,
        groups: Callable[[int, str], int],
        dtype: torch.dtype,
    ) -> None:
        """groups(input columns, name): how many scales each row of a projection has."""
        super().__init__(config, moe, parallel)
        hidden, width = config.hidden_size, self.local_intermediate
        w13_groups, w2_groups = groups(hidden, "the experts' gate_up"), groups(width, "the experts' down")
        self.w13 = nn.ModuleList(
            Int8Linear(hidden, 2 * width, False, w13_groups, dtype) for _ in self.local_experts
        )
        self.w2 = nn.ModuleList(
            Int8Linear(width, hidden, False, w2_groups, dtype) for _ in self.local_experts
        )

    def expert_mlp(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        routed = [e for e, size in enumerate(sizes) if size]  # the other experts' weights are not read
        rows = [sizes[e] for e in routed]
        gate_up = grouped_int8_linear(x, [self.w13[e] for e in routed], rows)
        return grouped_int8_linear(self.act_fn(gate_up), [self.w2[e] for e in routed], rows)

    def load(
        self, part: str, expert: int | None, tensor: torch.Tensor, hf_name: str, held: str = "weight"
    ) -> None:
        if expert is None:
            raise ValueError(
                f"checkpoint tensor {hf_name!r}: quantized experts are read one by one, as "
                "compressed-tensors writes them, not stacked"
            )
        local = expert - self.local_experts.start
        projection = self.w2[local] if part == "down" else self.w13[local]
        target = getattr(projection, held).data
        if part != "down":
            width = self.local_intermediate
            target = target.narrow(0, 0 if part == "gate" else width, width)
        copy_checkpoint_tensor(target, tensor, hf_name)


class GroupedLinear(CustomOp):
    """x's rows in consecutive groups, sizes[e] rows for expert e, each group times weight[e] transposed
    (weight [experts, out, in]) -> [rows, out]: one torch._grouped_mm call for float32 on the CPU where the
    row strides allow it (multiples of 16 bytes), Triton's grouped GEMM on CUDA for a few rows per expert,
    a matmul per expert otherwise."""

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat(
            [F.linear(rows, expert) for rows, expert in zip(x.split(sizes), weight, strict=True)]
        )

    def forward_cpu(self, x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        if not (x.is_contiguous() and grouped_mm_fits(x, weight)):
            return self.forward_native(x, weight, sizes)
        offsets = torch.tensor(list(accumulate(sizes)), dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    def forward_cuda(self, x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        from kvfleet.runtime.kernels.grouped_gemm import grouped_gemm

        # cuBLAS per expert wins once each expert has many rows: on an H200 at Mixtral-8x7B's shapes the
        # grouped kernel was 8% faster at 16 rows per expert and 1.3x slower at 2,048.
        if max(sizes, default=0) > GROUPED_GEMM_MAX_ROWS:
            return self.forward_native(x, weight, sizes)
        return grouped_gemm(x, weight, sizes)


def grouped_mm_fits(*tensors: torch.Tensor) -> bool:
    """Whether torch's grouped matmul on the CPU takes these operands: every stride but the last dim's a
    multiple of 16 bytes."""
    return all(
        stride * tensor.element_size() % 16 == 0 for tensor in tensors for stride in tensor.stride()[:-1]
    )


class SparseMoeBlock(nn.Module):
    """The router and the experts of one layer, in place of its MLP."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.moe = moe
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts: RoutedExperts = FusedMoE(config, moe, parallel)
        # Token-expert pairs routed to each expert since the model was loaded (every rank counts them all).
        self.register_buffer(
            "expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        probabilities = torch.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        weights, experts = probabilities.topk(moe.num_experts_per_tok, dim=-1)
        if moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if moe.routing_weights_in_activation_dtype:
            weights = weights.to(hidden.dtype)
        counts = torch.bincount(experts.flatten(), minlength=moe.num_experts)
        self.expert_tokens += counts
        return self.parallel.all_reduce(self.experts(hidden, weights, experts, counts.tolist()))


class MoeForCausalLM(LlamaForCausalLM):
    """Serves MixtralForCausalLM and Qwen3MoeForCausalLM."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        if config.moe is None:
            raise ValueError(
                f"{config.architecture} needs a mixture-of-experts config.json (model_type mixtral or "
                f"qwen3_moe), got model_type {config.model_type!r}"
            )
        self.moe = config.moe
        super().__init__(config, attention, max_position)
        # The sparse layers this rank holds, by their index in the whole model: each step reports their load.
        self._sparse_blocks = {
            self.first_layer + i: layer.mlp
            for i, layer in enumerate(self.layers)
            if isinstance(layer.mlp, SparseMoeBlock)
        }

    def make_mlp(self, layer: int) -> nn.Module:
        if self.moe.sparse_layers[layer]:
            return SparseMoeBlock(self.config, self.moe, self.parallel)
        return super().make_mlp(layer)

    def expert_load(self) -> list[MoeLayerLoad]:
        """For each sparse layer this rank holds: the token-expert pairs routed, and to the busiest expert."""
        blocks = self._sparse_blocks
        if not blocks:
            return []
        # Summed in Python, once a step: torch's reductions of a few numbers cost more on busy cores.
        counts = torch.stack([block.expert_tokens for block in blocks.values()]).tolist()
        return [
            MoeLayerLoad(layer, self.moe.num_experts, sum(per_expert), max(per_expert))
            for layer, per_expert in zip(blocks, counts, strict=True)
        ]

    def quantize_experts(
        self, quantized: Iterable[str], groups: Callable[[int, str], int], dtype: torch.dtype
    ) -> dict[str, int]:
        """Hold in int8 the experts of each sparse layer of this rank whose projections a checkpoint quantizes
        (`quantized`: the names of its quantized projections, less `.weight`; `groups` as `Int8Experts`
        takes it). Returns those of them that are this rank's experts', with their input columns here."""
        columns = {}
        for name in quantized:
            match = _EXPERT_TENSOR.fullmatch(f"{name}.weight")
            experts = None if match is None else self._experts(int(match["layer"]))
            if match is None or experts is None or int(match["expert"]) not in experts.local_experts:
                continue
            if isinstance(experts, FusedMoE):
                block = self.layers[int(match["layer"]) - self.first_layer].mlp
                experts = block.experts = Int8Experts(self.config, self.moe, self.parallel, groups, dtype)
            down = _PART[match["projection"]] == "down"
            columns[name] = experts.local_intermediate if down else self.config.hidden_size
        return columns

    def checkpoint_slice(self, hf_name: str, shape: list[int]) -> tuple[slice, ...] | None:
        match = _EXPERT_TENSOR.fullmatch(hf_name)
        if match is None:
            return super().checkpoint_slice(_router_name(hf_name), shape)
        layer = int(match["layer"]) - self.first_layer
        everything = tuple(slice(None) for _ in shape)
        if not 0 <= layer < len(self.layers):
            return None  # another stage's layer
        experts = self._experts(int(match["layer"]))
        if experts is None:
            return everything  # a dense layer: load_weights refuses the tensor by name
        local = experts.local_experts
        columns = _range(experts.intermediate_start, experts.local_intermediate)
        if match["expert"] is not None:
            if int(match["expert"]) not in local:
                return None
            if match["tensor"] == "weight_shape" or len(shape) == 1:
                return everything  # a packed weight's shape, or its one scale (fp8's per-tensor strategy)
            if _PART[match["projection"]] != "down":
                return (columns, slice(None))
            if self.parallel.enable_expert_parallel:
                return everything
            # The rank's share of the down projection's input columns: of its weight's, or of a quantized
            # one's packed words or group scales.
            return input_columns(hf_name, shape[1], self.parallel.tp_size, self.parallel.tp_rank)
        own_experts = _range(local.start, len(local))
        if match["stacked"] == "down_proj":
            return (own_experts, slice(None), columns)
        return (own_experts, *everything[1:])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The dense model's loading, with the experts' tensors copied into their stacks on the way; raises
        ValueError naming an expert's tensor that the checkpoint lacks."""
        filled: set[tuple[int, int, str]] = set()

        def dense_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                match = _EXPERT_TENSOR.fullmatch(hf_name)
                if match is None:
                    yield _router_name(hf_name), tensor
                    continue
                layer = int(match["layer"])
                experts = self._experts(layer)
                if experts is None:
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}"
                    )
                if match["stacked"] is not None:
                    part = "gate_up" if match["stacked"] == "gate_up_proj" else "down"
                    experts.load(part, None, tensor, hf_name)
                    filled.update((layer, e, p) for e in experts.local_experts for p in _PARTS_OF[part])
                    continue
                expert, part, held = int(match["expert"]), _PART[match["projection"]], match["tensor"]
                if held not in ("weight", "weight_scale"):
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} is packed: config.json has no quantization_config "
                        "that says how"
                    )
                experts.load(part, expert, tensor, hf_name, held)
                if held == "weight":
                    filled.add((layer, expert, part))

        super().load_weights(dense_tensors())
        missing = [
            f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
            for layer, experts in self._sparse_layers()
            for expert in experts.local_experts
            for part in _PARTS
            if (layer, expert, part) not in filled
        ]
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} expert tensors, e.g. {', '.join(missing[:4])}"
            )

    def _expected_checkpoint_names(self) -> list[str]:
        """The dense model's, with each sparse layer's MLP tensors replaced by its router's (its experts are
        checked by load_weights)."""
        sparse = {layer for layer, _ in self._sparse_layers()}
        names = [
            name
            for name in super()._expected_checkpoint_names()
            if not (".mlp." in name and int(name.split(".")[2]) in sparse)
        ]
        return names + [f"model.layers.{layer}.mlp.gate.weight" for layer in sorted(sparse)]

    def _sparse_layers(self) -> list[tuple[int, RoutedExperts]]:
        return [
            (self.first_layer + i, layer.mlp.experts)
            for i, layer in enumerate(self.layers)
            if isinstance(layer.mlp, SparseMoeBlock)
        ]

    def _experts(self, layer: int) -> RoutedExperts | None:
        """The experts of a layer (numbered in the whole model) if this rank holds it and it is sparse."""
        local = layer - self.first_layer
        if not 0 <= local < len(self.layers):
            return None
        block = self.layers[local].mlp
        return block.experts if isinstance(block, SparseMoeBlock) else None


def _router_name(hf_name: str) -> str:
    """Mixtral's checkpoints keep the router under block_sparse_moe, Transformers' model under mlp."""
    return hf_name.replace(".block_sparse_moe.", ".mlp.")


def _range(start: int, length: int) -> slice:
    return slice(start, start + length)
